"""Generic behaviour of every optimizer, driven by the OptimInfo table. The loop ground truth pinned to
independent facts (published recurrences, hand-derived values, documented defaults): tests/test_ground_truth.py."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import nonans_optim as no
from nonans_optim.ns5 import hot_dtype
from optim_infos import (IDS, INFOS, loss_fn, make_batch, make_model, no_host_sync, same_tree, state_tensors,
                         train_steps)


@pytest.mark.parametrize("info", INFOS, ids=IDS)
@pytest.mark.parametrize("bad", [dict(lr=-1.0), dict(lr=float("nan")), dict(lr=float("inf")),
                                 dict(weight_decay=-0.1), dict(betas=(1.0, 0.9)), dict(betas=(0.9, -0.1)),
                                 dict(betas=(0.9,)), dict(betas=(0.9, 0.99, 0.999)), dict(warmup_steps=-1),
                                 dict(warmup_steps=2.5), dict(warmup_steps="10"),
                                 # a bool is an int to Python; lr=True (1.0) or warmup_steps=True (1) is a slip
                                 dict(lr=True), dict(warmup_steps=True)])
def test_bad_hyperparameters_raise_naming_the_argument(info, bad):
    model = make_model()
    name = next(iter(bad))
    with pytest.raises(ValueError, match=name):
        info.make(model.parameters(), **bad)


@pytest.mark.parametrize("bad", [dict(ns_steps=0), dict(ns_steps=1.5), dict(shampoo_refresh_every=0),
                                 dict(ns5_dtype="int8"), dict(ns5_dtype=torch.int32),
                                 # ±Inf passed and overflowed the MONA buffers at every step; "no" is truthy
                                 dict(mona_alpha=float("inf")), dict(mona_alpha="0.1"), dict(polyak="no"),
                                 dict(polyak=None),
                                 # a dead row (v = 0) divided 0 by 0 and held the whole matrix every step;
                                 # a β whose reciprocal overflows fp32 stepped, then eval() raised
                                 dict(normuon_eps=0.0), dict(sf_beta=1e-40),
                                 # 1/(√0 + eps) was Inf below fp32's smallest normal: 0·Inf = NaN on a dead row
                                 # in the fused and compiled paths, every step (the fuzz audit)
                                 dict(normuon_eps=1e-40), dict(normuon_eps=1e-46)])
def test_bad_spectral_hyperparameters_raise_at_construction(bad):
    """Caught where the typo is made, not at the first step()."""
    with pytest.raises(ValueError, match=next(iter(bad))):
        no.FullFusion(make_model().parameters(), **bad)


@pytest.mark.parametrize("cls", [no.AdamW, no.SFAdamW, no.SFNorMuon, no.FullFusion])
@pytest.mark.parametrize("bad", [dict(lr=1e39), dict(weight_decay=1e300), dict(eps=1e39)])
def test_hyperparameters_past_fp32_range_raise_at_construction(cls, bad):
    """The step computes in fp32: an lr of 1e39 or a weight decay of 1e300 passed validation and raised
    inside step() after the global step (and, for FullFusion, one parameter's step) had advanced."""
    with pytest.raises(ValueError, match=next(iter(bad))):
        cls(make_model().parameters(), **bad)
    opt = cls(make_model().parameters(), lr=3e38)  # the largest fp32 is still a valid (absurd) rate
    with pytest.raises(ValueError, match="lr"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(2))], "lr": 1e39})


def test_unknown_component_is_named():
    with pytest.raises(ValueError, match="adam"):
        no.Fusion(make_model().parameters(), components=("ns5", "adam"))


def test_sfadamw_refuses_an_interpolation_weight_whose_reciprocal_overflows():
    with pytest.raises(ValueError, match="betas"):
        no.SFAdamW(make_model().parameters(), betas=(1e-40, 0.999))
    no.SFAdamW(make_model().parameters(), betas=(1e-20, 0.999)).eval()  # small but representable: fine


def test_components_given_as_one_string_says_so():
    """A string is a collection of characters: components="ns5" was refused as unknown ['5', 'n', 's']."""
    with pytest.raises(ValueError, match=r"collection of names, e.g. \('ns5',\)"):
        no.Fusion(make_model().parameters(), components="ns5")


def test_mona_alpha_takes_any_finite_number_or_a_cpu_tensor_like_every_hyperparameter():
    """A one-element CPU tensor is accepted for every hyperparameter (README); mona_alpha refused it, while
    it let ±Inf through. It may be negative (a mixing weight); it is stored as a float."""
    for alpha in (torch.tensor(0.3), -0.5, 2):
        opt = no.FullFusion(make_model().parameters(), mona_alpha=alpha)
        assert type(opt.param_groups[0]["mona_alpha"]) is float
        assert opt.param_groups[0]["mona_alpha"] == float(alpha)


@pytest.mark.parametrize("info", INFOS, ids=IDS)
def test_duplicate_parameters_raise(info):
    model = make_model()
    params = list(model.parameters())
    with pytest.raises(ValueError, match="duplicate"):
        info.make(params + params[:1])


@pytest.mark.parametrize("info", INFOS, ids=IDS)
def test_sparse_gradient_raises_before_any_state_change(info):
    emb = nn.Embedding(10, 4, sparse=True)
    lin = nn.Linear(4, 4)
    opt = info.make(list(emb.parameters()) + list(lin.parameters()))
    before = [p.detach().clone() for p in list(emb.parameters()) + list(lin.parameters())]
    lin(emb(torch.tensor([1, 2]))).sum().backward()
    with pytest.raises(RuntimeError, match="sparse"):
        opt.step()
    after = list(emb.parameters()) + list(lin.parameters())
    assert all(torch.equal(a, b) for a, b in zip(before, after))
    assert len(opt.state) == 0


@pytest.mark.parametrize("info", INFOS, ids=IDS)
def test_complex_parameters_raise(info):
    with pytest.raises(ValueError, match="complex"):
        info.make([nn.Parameter(torch.zeros(3, 3, dtype=torch.complex64))])


@pytest.mark.parametrize("info", INFOS, ids=IDS)
def test_moves_downhill(info):
    model = make_model()
    opt = info.make(model.named_parameters())
    batch = make_batch(5)
    start = loss_fn(model, batch).item()
    for _ in range(5):
        opt.zero_grad()
        loss = loss_fn(model, batch)
        loss.backward()
        opt.step()
    if info.schedule_free:
        opt.eval()
    assert loss_fn(model, batch).item() < start


@pytest.mark.parametrize("info", INFOS, ids=IDS)
def test_loop_and_foreach_agree(info):
    models = [make_model() for _ in range(2)]
    opts = [info.make(m.named_parameters(), impl=impl) for m, impl in zip(models, ("loop", "foreach"))]
    for m, o in zip(models, opts):
        train_steps(m, o, 8)
    for a, b in zip(*(m.parameters() for m in models)):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    sa, sb = state_tensors(opts[0]), state_tensors(opts[1])
    assert sa.keys() == sb.keys()
    for k in sa:
        torch.testing.assert_close(sa[k], sb[k], rtol=1e-4, atol=1e-5, msg=k)


@pytest.mark.parametrize("info", INFOS, ids=IDS)
def test_state_dict_resume_is_bit_identical(info):
    ref_model = make_model()
    ref = info.make(ref_model.named_parameters())
    train_steps(ref_model, ref, 10, seed=0)

    model = make_model()
    opt = info.make(model.named_parameters())
    train_steps(model, opt, 10, seed=0)
    ckpt_model = copy.deepcopy(model.state_dict())
    ckpt_opt = copy.deepcopy(opt.state_dict())

    resumed_model = make_model(seed=123)
    resumed_model.load_state_dict(ckpt_model)
    resumed = info.make(resumed_model.named_parameters())
    resumed.load_state_dict(ckpt_opt)

    train_steps(ref_model, ref, 10, seed=7)
    train_steps(resumed_model, resumed, 10, seed=7)
    for a, b in zip(ref_model.parameters(), resumed_model.parameters()):
        assert torch.equal(a, b)
    sa, sb = state_tensors(ref), state_tensors(resumed)
    assert sa.keys() == sb.keys()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert ref.metrics() == resumed.metrics()


@pytest.mark.parametrize("src", INFOS[:6], ids=IDS[:6])
@pytest.mark.parametrize("dst", INFOS[:6], ids=IDS[:6])
def test_state_dict_of_another_optimizer_is_refused_before_anything_changes(src, dst):
    """A checkpoint saved by another optimizer (or other components) is refused by load_state_dict,
    naming what is missing, with the loading optimizer's state and hyperparameters untouched. torch's own
    load would swap the state in and fail with a KeyError at the next step(). Loading one's own kind
    continues; a checkpoint that has more state than needed (FullFusion's into SF-NorMuon) is accepted.
    What decides is the per-parameter state: group keys a checkpoint lacks come from the loading
    optimizer (tests/test_checkpoint_conventions.py: torch.optim.AdamW's checkpoint into AdamW)."""
    model = make_model()
    a, b = src.make(model.named_parameters()), dst.make(model.named_parameters())
    train_steps(model, a, 2)
    train_steps(model, b, 2)
    saved, before = a.state_dict(), copy.deepcopy(b.state_dict())
    fits = all(set(before["state"][i]) <= set(saved["state"].get(i, {})) for i in before["state"])
    if fits:
        b.load_state_dict(saved)
        train_steps(model, b, 1)
        return
    with pytest.raises(ValueError, match="does not fit"):
        b.load_state_dict(saved)
    assert same_tree(b.state_dict(), before)


@pytest.mark.parametrize("info", INFOS, ids=IDS)
def test_params_without_grads_are_untouched(info):
    model = make_model()
    opt = info.make(model.named_parameters())
    model.fc2.weight.requires_grad_(False)
    model.norm.bias.requires_grad_(False)
    frozen = [model.fc2.weight.detach().clone(), model.norm.bias.detach().clone()]
    train_steps(model, opt, 3)
    assert torch.equal(frozen[0], model.fc2.weight) and torch.equal(frozen[1], model.norm.bias)
    assert model.fc2.weight not in opt.state and model.norm.bias not in opt.state


@pytest.mark.parametrize("info", INFOS, ids=IDS)
@pytest.mark.parametrize("shape", [(0, 4), (4, 0), (0, 3, 3, 3)])
def test_empty_parameters_step_beside_the_others(info, shape):
    """An empty weight (a zero-width layer) is a no-op beside a real one, on every path: routing used to
    index its first row to find the matrix shape and raised IndexError."""
    empty, w = nn.Parameter(torch.zeros(shape)), nn.Parameter(torch.randn(6, 5))
    opt = info.make([empty, w])
    before = w.detach().clone()
    for _ in range(3):
        empty.grad, w.grad = torch.zeros(shape), torch.randn(6, 5)
        opt.step()
    assert empty.shape == shape and torch.isfinite(w).all() and not torch.equal(w, before)


@pytest.mark.parametrize("info", INFOS, ids=IDS)
def test_lr_scheduler_drives_the_step(info):
    models = [make_model() for _ in range(2)]
    opts = [info.make(m.named_parameters()) for m in models]
    sched = torch.optim.lr_scheduler.StepLR(opts[1], step_size=1, gamma=0.0)  # lr 0 after the first step
    train_steps(models[0], opts[0], 1)
    train_steps(models[1], opts[1], 1)
    sched.step()
    assert opts[1].param_groups[0]["lr"] == 0.0
    before = [p.detach().clone() for p in models[1].parameters()]
    train_steps(models[1], opts[1], 2, seed=3)
    moved = [not torch.equal(a, b) for a, b in zip(before, models[1].parameters())]
    # lr 0 moves nothing — schedule-free included: z stays, and with c = 0 x and so y stay too
    assert not any(moved)


@pytest.mark.parametrize("info", INFOS, ids=IDS)
def test_tensor_lr_matches_float_lr(info, monkeypatch):
    """torch.optim's convention: lr may be a tensor, and an LR scheduler keeps it one (fill_). The steps are
    those of the same float lr, bit for bit; and where the schedule-free weight does not need η_t on the host,
    step() never reads the tensor there (a CUDA lr would be a device sync every step)."""
    models = [make_model() for _ in range(2)]
    lr = torch.tensor(3e-3)
    opts = [info.make(models[0].named_parameters(), lr=3e-3), info.make(models[1].named_parameters(), lr=lr)]
    scheds = [torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.5) for o in opts]
    reads = []
    for real in (torch.Tensor.__float__, torch.Tensor.item):
        def watched(self, *a, _real=real, **k):
            if self is lr:
                reads.append(_real.__name__)
            return _real(self, *a, **k)
        monkeypatch.setattr(torch.Tensor, real.__name__, watched)
    for i in range(3):
        for m, o, sch in zip(models, opts, scheds):
            train_steps(m, o, 1, seed=i)
            sch.step()
    monkeypatch.undo()
    assert isinstance(opts[1].param_groups[0]["lr"], torch.Tensor) and float(lr) == pytest.approx(3e-3 / 8)
    assert all(torch.equal(a, b) for a, b in zip(*(m.parameters() for m in models)))
    assert (len(reads) > 0) == bool(info.schedule_free), reads


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("cls", [no.AdamW, no.Muon, no.SFAdamW], ids=lambda c: c.__name__)
def test_cuda_tensor_lr_needs_no_host_sync(cls):
    """A CUDA lr: γ is computed on the device (no sync in step()); the schedule-free weight is the one
    reader of η_t on the host, and it says so once."""
    model = make_model().cuda()
    opt = cls(model.parameters(), lr=torch.tensor(1e-3, device="cuda"))
    tokens, img, y = (t.cuda() for t in make_batch(0))
    for i in range(3):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(tokens, img), y).backward()
        if cls is no.SFAdamW:
            with pytest.warns(RuntimeWarning, match="device sync"):
                opt.step()
            continue
        if i == 0:  # state creation
            opt.step()
            continue
        with no_host_sync():
            opt.step()
    assert all(torch.isfinite(p).all() for p in model.parameters())


@pytest.mark.parametrize("info", INFOS, ids=IDS)
def test_train_eval_round_trip(info):
    model = make_model()
    opt = info.make(model.named_parameters())
    train_steps(model, opt, 5)
    y = [p.detach().clone() for p in model.parameters()]
    opt.eval()
    x = [p.detach().clone() for p in model.parameters()]
    opt.eval()  # idempotent
    assert all(torch.equal(a, b) for a, b in zip(x, model.parameters()))
    opt.train()
    for a, b in zip(y, model.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    if info.schedule_free:
        assert any(not torch.allclose(a, b) for a, b in zip(x, y))
        opt.eval()
        with pytest.raises(RuntimeError, match="train\\(\\)"):
            opt.step()
    else:
        assert all(torch.equal(a, b) for a, b in zip(x, y))


@pytest.mark.parametrize("info", INFOS, ids=IDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_dtype_is_preserved(info, dtype):
    model = make_model(dtype=dtype, small=True)  # fp64 "-fused" runs compiled: SmallNet compiles less
    opt = info.make(model.named_parameters())
    for i in range(3):
        opt.zero_grad()
        loss_fn(model, make_batch(i, dtype=dtype)).backward()
        opt.step()
    for p in model.parameters():
        assert p.dtype == dtype and torch.isfinite(p).all()
        for k, v in opt.state[p].items():
            if k in ("exp_avg", "exp_avg_sq", "z"):
                assert v.dtype == dtype, k
            if k == "momentum_buffer":  # momentum_dtype="auto": bf16 where NS5 runs in bf16 (Fusion docs)
                hot = hot_dtype(p.device, "auto")
                assert v.dtype == (torch.bfloat16 if hot == torch.bfloat16 else dtype), k


def test_momentum_dtype_param_keeps_the_parameter_dtype_and_bad_values_are_named():
    model = make_model()
    opt = no.SFNorMuon(no.param_groups(model), momentum_dtype="param")
    loss_fn(model, make_batch(0)).backward()
    opt.step()
    bufs = [st["momentum_buffer"] for st in opt.state.values() if "momentum_buffer" in st]
    assert bufs and all(b.dtype == torch.float32 for b in bufs)
    with pytest.raises(ValueError, match="momentum_dtype.*'fp8'"):
        no.SFNorMuon(model.parameters(), momentum_dtype="fp8")


@pytest.mark.parametrize("info", INFOS, ids=IDS)
def test_polyak_metrics_and_set_loss(info):
    model = make_model()
    opt = info.make(model.named_parameters())
    train_steps(model, opt, 3)
    m = opt.metrics()
    assert all(isinstance(v, float) for v in m.values())
    if getattr(opt, "_uses_polyak", False):
        assert {"fusion/loss_ema", "fusion/gnorm_ema", "fusion/gamma_curr"} <= m.keys()
        assert 0.1 * opt.param_groups[0]["lr"] <= m["fusion/gamma_curr"] <= 10 * opt.param_groups[0]["lr"]
    with pytest.raises(ValueError, match="scalar"):
        opt.set_loss(torch.ones(3))


def test_adamw_matches_torch_adamw_on_clean_steps():
    models = [make_model() for _ in range(2)]
    ours = no.AdamW(models[0].parameters(), lr=1e-2, weight_decay=0.1)
    ref = torch.optim.AdamW(models[1].parameters(), lr=1e-2, weight_decay=0.1)
    train_steps(models[0], ours, 10)
    train_steps(models[1], ref, 10)
    for a, b in zip(*(m.parameters() for m in models)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("info", [i for i in INFOS if i.schedule_free], ids=lambda i: i.name)
def test_checkpoint_taken_in_eval_mode_resumes_correctly(info):
    """Save after eval() (params hold x), load into a fresh optimizer, train(): params must be y again."""
    model = make_model()
    opt = info.make(model.named_parameters())
    train_steps(model, opt, 4)
    y = [p.detach().clone() for p in model.parameters()]
    opt.eval()
    ckpt_model, ckpt_opt = copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())
    fresh_model = make_model(seed=5)
    fresh_model.load_state_dict(ckpt_model)
    fresh = info.make(fresh_model.named_parameters())
    fresh.load_state_dict(ckpt_opt)
    with pytest.raises(RuntimeError, match="eval mode"):
        fresh.step()
    fresh.train()
    for a, b in zip(y, fresh_model.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
