"""The Triton record kernel (``kernels/record.py``) against the torch record it replaces on CUDA
(``Resolution.record_step``, the ground truth), and wired into the optimizers.

Same two-faced layout as ``test_kernels_scalar_step.py``: a normal run re-runs this file under
``TRITON_INTERPRET=1`` in a subprocess (CPU tensors), and runs the ``gpu``-marked copies on CUDA.

Pinned down, for random counter states and step counts (hypothesis): every Resolution tensor after one
record equals the torch record's bit for bit — the cumulative counts and events, the escalation (scale,
clean streak, escalations), the event ring (counts, step, escalated and held bits, write pointer) — across
parameter counts that cross the kernel's block of parameters, ring wrap-around, sparse and whole-tensor
events, the loss stage (counted, nobody's event) and a scale at its floor or ceiling; a launch that fails
falls back to the torch record, once and for good, with the same results.
"""
from __future__ import annotations

import os

import pytest
import torch
from interpreted import GPU_COPY, assert_interpreted_suite_passes, marker

pytest.importorskip("triton")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from nonans_optim.resolution import STAGE_INDEX, STAGES, Resolution  # noqa: E402
from optim_infos import assert_resolution_matches  # noqa: E402

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
CUDA = torch.cuda.is_available()
S = len(STAGES)


def _state(draw, device):
    """A Resolution of P parameters in a random reachable-looking state, and a step's (P, S, 2) counts."""
    P = draw(st.integers(1, 150))
    K = draw(st.integers(1, 6))
    seed = draw(st.integers(0, 2**31 - 1))
    gen = torch.Generator().manual_seed(seed)
    # some empty parameters: a whole-tensor count of 0 on them is no hold
    numels = torch.where(torch.rand(P, generator=gen) < 0.15, 0, torch.randint(1, 40, (P,), generator=gen)).tolist()
    res = Resolution("repair", P, torch.device(device), ring_size=K, numels=numels,
                     repeat_window=draw(st.integers(1, 12)), growth_interval=draw(st.integers(1, 8)))

    def rand(hi, shape, density):
        values = torch.randint(0, hi, shape, generator=gen)
        return torch.where(torch.rand(shape, generator=gen) < density, values, torch.zeros_like(values))

    t = res.tensors
    t["counts"].copy_(rand(50, (P, S, 2), 0.3))
    t["events"].copy_(rand(5, (P, S), draw(st.sampled_from([0.0, 0.1, 0.5]))))
    t["clean_streak"].copy_(torch.randint(0, 15, (P,), generator=gen))
    t["scale"].copy_(2.0 ** -torch.randint(0, 12, (P,), generator=gen).float())  # at the floor 2^-10 and below
    t["escalations"].copy_(rand(4, (P,), 0.2))
    t["ring_ptr"].fill_(draw(st.integers(0, 3 * K)))
    sc = rand(40, (P, S, 2), draw(st.sampled_from([0.0, 0.02, 0.2, 1.0])))
    whole = torch.rand(P, generator=gen) < draw(st.sampled_from([0.0, 0.3]))  # no finite gradient entry
    n = torch.tensor(numels)
    sc[:, STAGE_INDEX["grad"], 0] = torch.where(whole, n, sc[:, STAGE_INDEX["grad"], 0])
    sc[:, STAGE_INDEX["grad"], 1] = torch.where(whole, torch.zeros_like(n), sc[:, STAGE_INDEX["grad"], 1])
    return res, sc.to(device), draw(st.integers(1, 10**6))


def case_kernel_matches_torch_record(device):
    from nonans_optim.kernels.record import record_step_

    @settings(max_examples=60 if device == "cpu" else 200, deadline=None,
              suppress_health_check=list(HealthCheck))
    @given(st.data())
    def check(data):
        res, sc, step = _state(data.draw, device)
        want = {k: v.clone() for k, v in res.tensors.items()}
        twin = Resolution("repair", res.num_params, torch.device(device), ring_size=want["ring_step"].shape[0])
        twin.tensors, twin.numel = want, res.numel
        twin.repeat_window, twin.growth_interval = res.repeat_window, res.growth_interval
        twin.record_step(step, sc)  # the torch record: native=False
        consume, before = data.draw(st.booleans()), sc.clone()
        record_step_(res.tensors, sc, step, numel=res.numel, backoff=res.backoff, min_scale=res.min_scale,
                     growth_interval=res.growth_interval, repeat_window=res.repeat_window,
                     loss_stage=STAGE_INDEX["loss"], grad_stage=STAGE_INDEX["grad"], consume=consume)
        for k, v in twin.tensors.items():
            assert torch.equal(res.tensors[k], v), k
        # consume: the block is left zeroed for the next step (after it was read: the counters above)
        assert torch.equal(sc, torch.zeros_like(sc) if consume else before)
    check()


def _assert_records_match(ref_opt, got_opt) -> None:
    """Every Resolution tensor and event of ``got_opt`` as ``ref_opt`` recorded them, the actions too."""
    assert_resolution_matches(ref_opt, got_opt)
    assert [e.action for e in got_opt.events] == [e.action for e in ref_opt.events]


def case_optimizers_record_through_the_kernel(device, monkeypatch):
    """AdamW(impl="fused") over test_fused's fault sequence records through the kernel (the torch record is
    made to fail the test) with the same counters and events as impl="loop"."""
    import nonans_optim as no
    from nonans_optim import _kernel_records, resolution
    from test_fused import _run

    monkeypatch.setenv("NONANS_FUSED_BACKEND", "triton")
    ref, ref_opt = _run(no.AdamW, "loop", "repair", device=device)
    calls = []
    real = resolution.Resolution._record_triton

    def counted(self, step, sc):
        calls.append(step)
        return real(self, step, sc)
    monkeypatch.setattr(resolution.Resolution, "_record_triton", counted)
    got, got_opt = _run(no.AdamW, "fused", "repair", device=device)
    assert calls and not _kernel_records._TRITON_RECORD_FAILED
    _assert_records_match(ref_opt, got_opt)
    # the step's count block is reused: the kernel consumed (zeroed) it, so no step has to fill it
    res = got_opt._resolution
    assert res._count_block is not None and not res._count_block_dirty
    assert not res._count_block.any()


def case_failed_record_falls_back_to_torch(device, monkeypatch):
    """A record launch that fails (a compile error, say) writes nothing: the step records with torch ops,
    warns once, and every later step stays on torch — the same counters and events as impl="loop"."""
    import nonans_optim as no
    from nonans_optim import _kernel_records
    from nonans_optim.kernels import record
    from test_fused import _run

    monkeypatch.setenv("NONANS_FUSED_BACKEND", "triton")
    monkeypatch.setattr(_kernel_records, "_TRITON_RECORD_FAILED", [])
    calls = []

    def broken(*args, **kwargs):
        calls.append(1)
        raise RuntimeError("planted compile error")
    monkeypatch.setattr(record, "record_step_", broken)
    ref, ref_opt = _run(no.AdamW, "loop", "repair", device=device)
    with pytest.warns(RuntimeWarning, match="planted compile error") as caught:
        got, got_opt = _run(no.AdamW, "fused", "repair", device=device)
    assert len(calls) == 1 and len([w for w in caught if "record kernel" in str(w.message)]) == 1
    _assert_records_match(ref_opt, got_opt)


def _define(device, marks=()):
    mark = marker(marks)

    @mark
    def test_failed_record_falls_back_to_torch(monkeypatch):
        case_failed_record_falls_back_to_torch(device, monkeypatch)

    @mark
    def test_kernel_matches_torch_record():
        case_kernel_matches_torch_record(device)

    @mark
    def test_optimizers_record_through_the_kernel(monkeypatch):
        case_optimizers_record_through_the_kernel(device, monkeypatch)

    return (test_kernel_matches_torch_record, test_optimizers_record_through_the_kernel,
            test_failed_record_falls_back_to_torch)


if INTERPRETED:
    (test_kernel_matches_torch_record, test_optimizers_record_through_the_kernel,
     test_failed_record_falls_back_to_torch) = _define("cpu")

    def test_strided_counts_are_refused():
        """The kernel walks flat memory: a strided count block is refused by name, and nothing is written."""
        from nonans_optim.kernels.record import record_step_

        res = Resolution("repair", 3, torch.device("cpu"), numels=[4, 4, 4])
        before = {k: v.clone() for k, v in res.tensors.items()}
        sc = torch.ones(S, 3, 2, dtype=torch.int64).transpose(0, 1)  # (3, S, 2), not contiguous
        with pytest.raises(ValueError, match="contiguous tensors on one device"):
            record_step_(res.tensors, sc, 1, numel=res.numel, backoff=0.5, min_scale=1e-3, growth_interval=10,
                         repeat_window=5, loss_stage=STAGE_INDEX["loss"], grad_stage=STAGE_INDEX["grad"])
        assert all(torch.equal(res.tensors[k], v) for k, v in before.items())
else:
    def test_interpreter_suite():
        """Run the cases under TRITON_INTERPRET=1 in a fresh process (see test_kernels_interpret.py)."""
        assert_interpreted_suite_passes(__file__, timeout=600)

    def test_cpu_default_never_records_on_triton(monkeypatch):
        """Without the interpreter and the forced backend, CPU counters never take the Triton record."""
        from nonans_optim._kernel_records import record_on_triton

        monkeypatch.delenv("NONANS_FUSED_BACKEND", raising=False)
        assert not record_on_triton(torch.device("cpu"))

    (test_gpu_kernel_matches_torch_record, test_gpu_optimizers_record_through_the_kernel,
     test_gpu_failed_record_falls_back_to_torch) = _define("cuda", marks=GPU_COPY)
