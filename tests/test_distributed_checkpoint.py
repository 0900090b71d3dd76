"""Checkpoints through ``torch.distributed.checkpoint`` (DCP): its state-dict API
(``get_optimizer_state_dict`` / ``set_optimizer_state_dict``, what FSDP2, torchtitan and the distributed
strategies of Lightning and accelerate call) and its storage (``dcp.save`` / ``dcp.load``), plus checkpoints
of the layout before the optimizer-level state moved into a parameter's state.

DCP maps every key of an optimizer's ``state`` to a parameter name; the optimizer-level state (global step,
Polyak EMAs, resolution counters) used to sit under a string key there, and every call raised
``KeyError: 'nonans'``. Single process, no process group: the layout is what is tested, not the collectives.
"""
from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_optimizer_state_dict,
                                                     set_optimizer_state_dict)

import nonans_optim as no
from nonans_optim._global_state import GLOBAL_KEY
from optim_infos import IDS, INFOS, event_tuples, make_model, same_tree, train_steps

sys.path.insert(0, str(Path(__file__).parent / "data"))
import legacy_checkpoint as legacy  # noqa: E402

FLAT = [False, True]
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


def _inject(step: int, model) -> None:
    """A NaN entry at step 1, a whole +Inf tensor at step 2: counters, events and an escalation to carry."""
    model = getattr(model, "module", model)  # (a DDP wrapper's)
    with torch.no_grad():
        if step == 1:
            model.fc1.weight.grad[0, 0] = float("nan")
        if step == 2:
            model.fc2.weight.grad.fill_(float("inf"))


def _trained(info, **kw):
    model = make_model()
    opt = info.make(model.named_parameters(), **kw)
    train_steps(model, opt, 3, inject=_inject)
    return model, opt


def _fresh_like(model, info, **kw):
    twin = make_model(seed=1)
    twin.load_state_dict(model.state_dict())
    return twin, info.make(twin.named_parameters(), **kw)


def _assert_same_run(model_a, opt_a, model_b, opt_b) -> None:
    train_steps(model_a, opt_a, 2, seed=7, inject=_inject)
    train_steps(model_b, opt_b, 2, seed=7, inject=_inject)
    for p, q in zip(model_a.parameters(), model_b.parameters()):
        assert torch.equal(p, q)
    assert same_tree(opt_a.state_dict(), opt_b.state_dict())
    assert event_tuples(opt_a) == event_tuples(opt_b) and opt_a.events
    assert opt_a.metrics() == opt_b.metrics()


@pytest.mark.parametrize("flatten", FLAT, ids=["nested", "flat"])
@pytest.mark.parametrize("info", INFOS, ids=IDS)
def test_dcp_state_dict_api_resumes_bit_identically(info, flatten):
    """get_optimizer_state_dict on a trained optimizer, set_optimizer_state_dict into a fresh one (which DCP
    first steps at lr 0 to create its state): both continue identically — parameters, every state tensor,
    the counters, events and metrics."""
    options = StateDictOptions(flatten_optimizer_state_dict=flatten)
    model_a, opt_a = _trained(info)
    saved = copy.deepcopy(get_optimizer_state_dict(model_a, opt_a, options=options))
    assert all(isinstance(k, str) for k in (saved if flatten else saved["state"]))  # parameter names only
    model_b, opt_b = _fresh_like(model_a, info)
    set_optimizer_state_dict(model_b, opt_b, saved, options=options)
    _assert_same_run(model_a, opt_a, model_b, opt_b)


@pytest.mark.parametrize("flatten", FLAT, ids=["nested", "flat"])
@pytest.mark.parametrize("info", [i for i in INFOS if i.name in ("AdamW-fused", "FullFusion")],
                         ids=["AdamW-fused", "FullFusion"])
def test_dcp_save_and_load_through_storage(info, flatten, tmp_path):
    """dcp.save to a directory and dcp.load into the state dict of a fresh optimizer (the torchtitan
    pattern): this needs every optimizer-level entry to exist, with the same shape, in the fresh optimizer
    — a list or a tensor whose length grows with the run would not load. Saved in eval mode (the
    schedule-free average in the parameters), so the mode travels too."""
    options = StateDictOptions(flatten_optimizer_state_dict=flatten)
    model_a, opt_a = _trained(info, resolution="skip")
    opt_a.resolution_policy = "repair"  # a policy change to carry: earlier events stay "skipped"
    train_steps(model_a, opt_a, 2, seed=3, inject=_inject)
    opt_a.eval()
    dcp.save({"model": model_a.state_dict(), "optim": get_optimizer_state_dict(model_a, opt_a, options=options)},
             checkpoint_id=str(tmp_path))
    model_b, opt_b = _fresh_like(make_model(seed=2), info)
    target = {"model": model_b.state_dict(), "optim": get_optimizer_state_dict(model_b, opt_b, options=options)}
    dcp.load(target, checkpoint_id=str(tmp_path))
    model_b.load_state_dict(target["model"])
    set_optimizer_state_dict(model_b, opt_b, target["optim"], options=options)
    assert {e.action for e in opt_b.events} == {"skipped", "repaired"}
    opt_a.train(), opt_b.train()
    _assert_same_run(model_a, opt_a, model_b, opt_b)


@pytest.mark.parametrize("info", INFOS[:6], ids=IDS[:6])
def test_optimizer_level_state_rides_on_the_first_trainable_parameter(info):
    """Only parameters key ``state``; the optimizer-level dict sits in one parameter's state — the first
    that requires grad, since DCP drops the state of frozen ones — and a step of that parameter's own
    state still happens (its state was not mistaken for initialised)."""
    model = make_model()
    model.embed.weight.requires_grad_(False)
    opt = info.make(model.parameters())
    train_steps(model, opt, 2)
    sd = opt.state_dict()
    assert all(isinstance(k, int) for k in sd["state"])
    carriers = [k for k, st in sd["state"].items() if GLOBAL_KEY in st]
    assert carriers == [1]  # conv.weight: parameter 0 (the embedding) is frozen
    assert sd["state"][1][GLOBAL_KEY]["step"] == 2
    own = opt._expected_state(opt.param_groups[0], 1, model.conv.weight)
    assert set(own) | {GLOBAL_KEY} == set(sd["state"][1])


def test_the_carrier_a_checkpoint_chose_stays_the_carrier():
    """Loaded into an optimizer whose first trainable parameter is another one (the embedding, frozen when
    saved, trains now), the optimizer-level state stays where the checkpoint put it — also in a copy, which
    looks for it afresh — instead of a new one (step 0) being started on the first trainable parameter. An
    old-layout checkpoint (the dict at the top of ``state``) moves to the first trainable parameter."""
    model = make_model()
    model.embed.weight.requires_grad_(False)
    opt = no.AdamW(model.parameters(), impl="foreach")
    train_steps(model, opt, 2)
    sd = opt.state_dict()
    old = copy.deepcopy(sd)
    old["state"][GLOBAL_KEY] = old["state"][1].pop(GLOBAL_KEY)  # the layout before commit fa21cf5
    twin = no.AdamW(model.parameters(), impl="foreach")
    twin.load_state_dict(old)
    assert [k for k, st in twin.state_dict()["state"].items() if GLOBAL_KEY in st] == [1]
    model.embed.weight.requires_grad_(True)
    resumed = no.AdamW(model.parameters(), impl="foreach")
    resumed.load_state_dict(sd)
    for o in (resumed, copy.deepcopy(resumed)):
        assert o.metrics()["optim/step"] == 2.0
        assert [k for k, st in o.state_dict()["state"].items() if GLOBAL_KEY in st] == [1]


def test_carrier_state_keeps_its_dtypes_on_a_bf16_carrier():
    """torch's load casts a parameter's floating state to the parameter's dtype; the counters and the
    Polyak EMAs of a bf16 carrier stay fp32 (as saved), so a resumed run counts and scales as before."""
    model = legacy.make_model().to(torch.bfloat16)
    opt = no.FullFusion(model.parameters(), lr=1e-2, impl="foreach")
    legacy.run(model, opt, range(1, 4))  # events, an escalation (scale 0.5), a Polyak multiplier
    twin = no.FullFusion(model.parameters(), lr=1e-2, impl="foreach")
    twin.load_state_dict(opt.state_dict())
    glob = twin._global()
    assert glob["polyak"]["loss_ema"].dtype == torch.float32
    assert glob["resolution"]["scale"].dtype == torch.float32
    assert same_tree(glob, opt._global())


@pytest.mark.parametrize("cls", [no.AdamW, no.FullFusion], ids=["AdamW", "FullFusion"])
def test_loading_does_not_alias_the_callers_checkpoint(cls):
    """Steps after a load leave the loaded dict's optimizer-level tensors as they were (they are copied).
    FullFusion's step writes its Polyak state in place (AdamW's replaces it, which would hide an alias)."""
    model = make_model()
    opt = cls(model.parameters(), impl="foreach")
    train_steps(model, opt, 2, inject=_inject)
    sd = opt.state_dict()
    frozen = copy.deepcopy(sd)
    twin = cls(model.parameters(), impl="foreach")
    twin.load_state_dict(sd)
    train_steps(model, twin, 2, inject=_inject)
    carrier = next(k for k, st in sd["state"].items() if GLOBAL_KEY in st)
    assert same_tree(sd["state"][carrier][GLOBAL_KEY], frozen["state"][carrier][GLOBAL_KEY])


@pytest.mark.parametrize("name", list(legacy.CASES))
def test_checkpoint_of_the_old_layout_resumes_as_the_old_code_did(name):
    """tests/data/legacy_checkpoint.pt was written by the code of the old layout (commit fa21cf5), with the
    steps that code took after it: loading it here continues the same — parameters to float tolerance
    (the NS5 matmuls may run another kernel on another CPU), events with their labels (the policy
    history, a list then, a tensor now), the escalation and every counter exactly."""
    case = torch.load(Path(__file__).parent / "data" / "legacy_checkpoint.pt", weights_only=False)[name]
    assert GLOBAL_KEY in case["optim"]["state"]  # really the old layout
    model = legacy.make_model()
    model.load_state_dict(case["model"])
    opt = getattr(no, name)(model.parameters(), **legacy.KW)
    opt.load_state_dict(case["optim"])
    assert GLOBAL_KEY not in opt.state_dict()["state"]  # saved again in the new layout
    if legacy.CASES[name].get("eval_at_save"):
        opt.train()
    legacy.run(model, opt, range(4, 7))
    got, want = legacy.summary(model, opt), case["final"]
    torch.testing.assert_close(got["params"], want["params"], rtol=1e-5, atol=1e-6)
    assert got["events"] == want["events"]
    assert {"skipped", "repaired"} <= {e[5] for e in got["events"]}
    exact = {k: v for k, v in want["metrics"].items() if k.startswith(("resolution/", "optim/"))}
    assert {k: got["metrics"][k] for k in exact} == exact


@pytest.fixture
def process_group():
    """A one-process gloo group on an in-memory store (no port to collide with other test workers)."""
    import torch.distributed as dist
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_ddp_model_resumes_through_dcp(process_group):
    """A DDP-wrapped model, trained through the wrapper (its gradient hooks): DCP names the state by the
    inner module's parameter names, and the continuation is the same."""
    info = next(i for i in INFOS if i.name == "FullFusion")
    model_a = torch.nn.parallel.DistributedDataParallel(make_model())
    opt_a = info.make(model_a.parameters())
    train_steps(model_a, opt_a, 3, inject=_inject)
    saved = copy.deepcopy(get_optimizer_state_dict(model_a, opt_a))
    assert set(saved["state"]) == {n for n, _ in make_model().named_parameters()}
    model_b = torch.nn.parallel.DistributedDataParallel(make_model(seed=1))
    model_b.module.load_state_dict(model_a.module.state_dict())
    opt_b = info.make(model_b.parameters())
    set_optimizer_state_dict(model_b, opt_b, saved)
    _assert_same_run(model_a, opt_a, model_b, opt_b)


@pytest.mark.parametrize("name", ["AdamW", "FullFusion"])
def test_dtensor_parameters_are_refused_with_a_clear_error(process_group, name):
    """FSDP2 / tensor-parallel parameters (DTensor) are not supported: refused where they are given. They
    used to reach the native loop, whose storage pointer is null for a DTensor: a segfault on the first
    step of the default AdamW; the other paths failed deep inside with "mixed torch.Tensor and DTensor"."""
    from torch.distributed.tensor import DeviceMesh, Shard, distribute_tensor
    from nonans_optim.optimizers._fused import pointers
    sharded = torch.nn.Parameter(distribute_tensor(torch.randn(4, 6), DeviceMesh("cpu", [0]), [Shard(0)]))
    with pytest.raises(ValueError, match="DTensor parameters are not supported"):
        getattr(no, name)([sharded])
    opt = getattr(no, name)([torch.nn.Parameter(torch.randn(3))])
    with pytest.raises(ValueError, match="DTensor"):
        opt.add_param_group({"params": [sharded]})
    assert len(opt.param_groups) == 1
    assert pointers([sharded]) is None  # and the native loops' own gate refuses its null pointer
    assert pointers([torch.empty(0)]) is not None  # (an empty tensor's null pointer is harmless)


@pytest.mark.parametrize("name", ["AdamW", "FullFusion"])
def test_zero_redundancy_optimizer_resumes_with_the_counters(process_group, name):
    """ZeroRedundancyOptimizer's state_dict keeps only parameter-keyed state: with the optimizer-level
    state under a string key, its resume lost the global step, the Polyak EMAs and the counters (1.5e-2 to
    3.4e-2 off the uninterrupted run after NaN events, events_total 2 → 0; an audit, 2026-11-25)."""
    from torch.distributed.optim import ZeroRedundancyOptimizer
    info = next(i for i in INFOS if i.name == name)

    def zero(model):
        return ZeroRedundancyOptimizer(model.parameters(), optimizer_class=info.cls,
                                       **{"impl": "foreach", **info.kwargs})

    model_a = make_model()
    opt_a = zero(model_a)
    train_steps(model_a, opt_a.optim, 3, inject=_inject)
    opt_a.consolidate_state_dict(0)
    saved = copy.deepcopy(opt_a.state_dict())
    model_b = make_model(seed=1)
    model_b.load_state_dict(model_a.state_dict())
    opt_b = zero(model_b)
    opt_b.load_state_dict(saved)
    assert opt_b.optim.metrics()["resolution/events_total"] == opt_a.optim.metrics()["resolution/events_total"] > 0
    _assert_same_run(model_a, opt_a.optim, model_b, opt_b.optim)


@pytest.mark.parametrize("name", list(legacy.CASES))
def test_an_optimizer_pickled_with_the_old_layout_unpickles_into_the_new(name):
    """pickle of a whole optimizer written by the old code (tests/data/legacy_checkpoint.pt): unpickled, its
    optimizer-level state sits in a parameter's state, it reports the counters and events it had, and it
    steps on."""
    import pickle
    case = torch.load(Path(__file__).parent / "data" / "legacy_checkpoint.pt", weights_only=False)[name]
    opt = pickle.loads(case["pickled"])
    assert GLOBAL_KEY not in opt.state and GLOBAL_KEY in opt.state_dict()["state"][0]
    params = opt.param_groups[0]["params"]
    assert legacy.summary(torch.nn.ParameterList(params), opt)["events"] == case["at_save"]["events"]
    got, saved = opt.metrics(), dict(case["at_save"]["metrics"])
    if "fusion/gamma_curr" in saved:  # the old code multiplied in double; γ is now rounded as a step rounds it
        assert got.pop("fusion/gamma_curr") == pytest.approx(saved.pop("fusion/gamma_curr"), rel=1e-6)
    assert got == saved
    if legacy.CASES[name].get("eval_at_save"):
        opt.train()
    legacy.run(torch.nn.ParameterList(params), opt, range(4, 7))
    assert all(torch.isfinite(p).all() for p in params) and opt.metrics()["optim/step"] == 6


def _two_rank_worker(rank: int, store: str, ckpt: str, name: str, out: str) -> None:
    """One of two DDP ranks (gloo, file store): train, dcp.save, keep training; then a fresh optimizer
    dcp.loads and takes the same steps. Writes both runs' parameters and metrics for the parent."""
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    try:
        info = next(i for i in INFOS if i.name == name)
        model = torch.nn.parallel.DistributedDataParallel(make_model())
        opt = info.make(model.parameters())
        train_steps(model, opt, 3, inject=_inject)  # the same batches on both ranks: the same counters
        dcp.save({"optim": get_optimizer_state_dict(model, opt)}, checkpoint_id=ckpt)
        saved_model = copy.deepcopy(model.module.state_dict())
        train_steps(model, opt, 2, seed=7, inject=_inject)
        twin = torch.nn.parallel.DistributedDataParallel(make_model(seed=1))
        twin.module.load_state_dict(saved_model)
        opt_b = info.make(twin.parameters())
        target = {"optim": get_optimizer_state_dict(twin, opt_b)}
        dcp.load(target, checkpoint_id=ckpt)
        set_optimizer_state_dict(twin, opt_b, target["optim"])
        train_steps(twin, opt_b, 2, seed=7, inject=_inject)
        torch.save({"a": [p.detach() for p in model.parameters()], "b": [p.detach() for p in twin.parameters()],
                    "ma": opt.metrics(), "mb": opt_b.metrics()}, f"{out}.{rank}")
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("name", ["AdamW-fused", "FullFusion"])
def test_two_ranks_save_and_load_through_dcp(name, tmp_path):
    """Two processes (DDP over gloo): dcp.save writes the ranks' replicated optimizer-level state once,
    dcp.load gives it back to both, and each rank continues exactly as it would have without the
    checkpoint. (A fault that only one rank sees after the all-reduce would differ per rank: then one
    rank's counters are the ones loaded.)"""
    import torch.multiprocessing as mp
    out = str(tmp_path / "out")
    mp.spawn(_two_rank_worker, args=(str(tmp_path / "store"), str(tmp_path / "ckpt"), name, out), nprocs=2)
    runs = [torch.load(f"{out}.{r}", weights_only=False) for r in range(2)]
    for run in runs:
        for p, q in zip(run["a"], run["b"]):
            assert torch.equal(p, q)
        assert run["ma"] == run["mb"] and run["ma"]["resolution/events_total"] > 0


@pytest.mark.parametrize("name", ["AdamW", "SFNorMuon"])
def test_freezing_the_carrier_mid_run_then_resuming_frozen_through_dcp(name, tmp_path):
    """Fine-tuning that freezes the first layer mid-run: the optimizer-level dict lived on that layer's
    weight (the first trainable parameter when it was made), and a resumed run — built with the layer
    frozen — looks for it under its own first trainable parameter: dcp.load failed ("Missing key ...
    nonans.step") where torch's AdamW resumes. The dict now moves with the freeze."""
    def build():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))

    def freeze(model):
        for p in model[0].parameters():
            p.requires_grad_(False)

    x, y = torch.randn(32, 8), torch.randn(32, 4)
    model = build()
    opt = getattr(no, name)(model.parameters(), lr=1e-2)
    for i in range(3):
        if i == 1:
            freeze(model)
        opt.zero_grad()
        ((model(x) - y) ** 2).mean().backward()
        opt.step()
    assert GLOBAL_KEY not in opt.state[model[0].weight] and GLOBAL_KEY in opt.state[model[2].weight]
    dcp.save({"optim": get_optimizer_state_dict(model, opt)}, checkpoint_id=str(tmp_path))
    twin = build()
    twin.load_state_dict(model.state_dict())
    freeze(twin)
    opt_b = getattr(no, name)(twin.parameters(), lr=1e-2)
    target = {"optim": get_optimizer_state_dict(twin, opt_b)}
    dcp.load(target, checkpoint_id=str(tmp_path))
    set_optimizer_state_dict(twin, opt_b, target["optim"])
    assert opt_b.metrics() == opt.metrics() and opt_b.metrics()["optim/step"] == 3.0
    for m, o in ((model, opt), (twin, opt_b)):
        o.zero_grad()
        ((m(x) - y) ** 2).mean().backward()
        o.step()
    for p, q in zip(model.parameters(), twin.parameters()):
        assert torch.equal(p, q)
