"""Tests for ``nonans_optim.watch``: which module is named, in which phase and where (input, output,
gradient), and which tensors count as non-finite. The watch object itself (hooks, reset, options, no host
syncs, model unchanged) is tested in tests/test_watch_hooks.py."""
from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from nonans_optim.watch import watch


class Log(nn.Module):
    def forward(self, x):
        return torch.log(x)


class Sqrt(nn.Module):
    def forward(self, x):
        return torch.sqrt(x)


class ClipZero(nn.Module):
    """max(x, 0) written as a product, so its backward multiplies (Inf·0 = NaN) instead of masking."""

    def forward(self, x):
        return x * (x > 0)


class DictOut(nn.Module):
    """Returns nested containers; only ``aux`` (inside a list inside a dict) is non-finite."""

    def forward(self, x):
        return {"main": x * 2, "extra": [x.sum(), torch.log(-x.abs() - 1)], "n": 3}


class NoTensor(nn.Module):
    def forward(self, x):
        return None


class Parent(nn.Module):
    """A NaN made by functional code in the parent's own forward, between two children."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        return self.c(self.b(torch.log(self.a(x) - 100.0)))


class Reuse(nn.Module):
    """One Linear called three times; the third call overflows fp32."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        with torch.no_grad():
            self.lin.weight.fill_(1e12)
            self.lin.bias.zero_()

    def forward(self, x):
        for _ in range(3):
            x = self.lin(x) * 100.0
        return x


class LogInPlace(nn.Module):
    """log taken in place: returns the very tensor it was given (same object), changed."""

    def forward(self, x):
        return x.log_()


class Scale(nn.Module):
    """x · s with its own parameter: one autograd node (MulBackward0) sends gradients to x and to s."""

    def __init__(self, value: float):
        super().__init__()
        self.s = nn.Parameter(torch.full((4,), value))

    def forward(self, x):
        return x * self.s


def mlp_with(middle: nn.Module) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), middle, nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2))


def all_hooks_empty(model: nn.Module) -> bool:
    return (all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())
            and all(not p._backward_hooks for p in model.parameters()))


class OwnGain(nn.Module):
    """A module with a child and a parameter of its own used in its forward body (a LayerScale-like
    gain, zero-initialised): sqrt(0) = 0 forward, so everything is finite but the gain's own gradient
    (d sqrt / d gain at 0 = Inf)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.gain = nn.Parameter(torch.zeros(4))

    def forward(self, x):
        return x + self.lin(x) * torch.sqrt(self.gain)


def test_middle_layer_nan_is_named_with_type_and_not_later_layers():
    model = mlp_with(Log())  # Linear output has negative entries: log gives NaN in layer "1"
    with watch(model) as w:
        model(torch.randn(16, 4)).sum().backward()
        first = w.first_nonfinite()
    assert first == {"phase": "forward", "module": "1", "type": "Log", "call": 0, "where": "output",
                     "inside": ""}


def test_clean_run_reports_none():
    model = mlp_with(nn.ReLU())
    with watch(model) as w:
        model(torch.randn(16, 4)).sum().backward()
        assert w.first_nonfinite() is None
        assert w.report() == {"forward": None, "backward": None}


def test_backward_only_nan_is_named_in_backward_phase():
    # ClipZero makes exact zeros; sqrt(0) = 0 forward, d/dx sqrt at 0 = Inf backward.
    model = mlp_with(nn.Sequential(ClipZero(), Sqrt()))
    with watch(model) as w:
        out = model(torch.randn(64, 4))
        assert w.report()["forward"] is None
        out.sum().backward()
        rep = w.report()
    assert rep["forward"] is None
    assert rep["backward"] == {"phase": "backward", "module": "1.1", "type": "Sqrt", "call": 0,
                               "where": "grad_input", "inside": "1"}
    assert w.first_nonfinite() == rep["backward"]
    assert not torch.isfinite(model[0].weight.grad).all()  # the test really produced a bad gradient


def test_nonfinite_gradient_from_the_loss_is_attributed_to_the_model_output():
    model = mlp_with(nn.ReLU())
    with watch(model) as w:
        out = model(torch.randn(8, 4))
        loss = torch.sqrt(out - out.detach()).sum()  # forward 0, backward Inf at the root's output
        loss.backward()
        rep = w.report()
    assert rep["forward"] is None
    assert rep["backward"]["module"] == "" and rep["backward"]["where"] == "grad_output"
    assert rep["backward"]["inside"] is None and rep["backward"]["type"] == "Sequential"


def test_functional_nan_in_parent_body_blames_the_parent_not_the_next_layer():
    model = Parent()
    with watch(model) as w:
        model(torch.randn(8, 4))
        first = w.first_nonfinite()
    assert first["module"] == "b" and first["where"] == "input" and first["inside"] == ""


def test_nonfinite_data_is_reported_at_the_root_input():
    model = mlp_with(nn.ReLU())
    x = torch.randn(8, 4)
    x[3, 1] = float("inf")
    with watch(model) as w:
        model(x)
        first = w.first_nonfinite()
    assert first == {"phase": "forward", "module": "", "type": "Sequential", "call": 0, "where": "input",
                     "inside": None}


def test_inputs_false_falls_back_to_first_bad_output():
    model = Parent()
    with watch(model, inputs=False) as w:
        model(torch.randn(8, 4))
        first = w.first_nonfinite()
    assert first["module"] == "b" and first["where"] == "output"


def test_module_called_several_times_reports_the_call_index():
    model = Reuse()
    with watch(model) as w:
        model(torch.ones(2, 4))
        first = w.first_nonfinite()
    assert first["module"] == "lin" and first["call"] == 2 and first["where"] == "output"


def test_nested_container_outputs_and_tensorless_outputs():
    model = nn.Sequential(nn.Linear(4, 4), NoTensor())
    with watch(model) as w:
        model(torch.randn(2, 4))
        assert w.first_nonfinite() is None
    holder = nn.ModuleDict({"d": DictOut()})
    with watch(holder) as w:
        holder["d"](torch.randn(3, 4))
        assert w.first_nonfinite()["module"] == "d"


def test_tuple_outputs_of_attention_and_a_realistic_transformer():
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(16, 2, dim_feedforward=32, dropout=0.0, batch_first=True)
    model = nn.TransformerEncoder(layer, num_layers=3, enable_nested_tensor=False)
    with torch.no_grad():
        model.layers[1].linear1.weight[0, 0] = float("nan")
    with watch(model) as w:
        model(torch.randn(2, 5, 16)).sum().backward()
        rep = w.report()
    assert rep["forward"]["module"] == "layers.1.linear1"
    assert rep["forward"]["type"] == "Linear" and rep["forward"]["where"] == "output"
    assert rep["backward"] is not None  # the NaN forward poisons gradients too


def test_a_tensor_changed_in_place_after_its_check_is_checked_again():
    """The Linear's finite output was checked; LogInPlace returns that same object made NaN in place. The
    skip-if-already-checked cache must see the new version and name LogInPlace, not report nothing."""
    model = nn.Sequential(nn.Linear(4, 4), LogInPlace())
    with watch(model) as w:
        with torch.no_grad():
            model(torch.randn(8, 4))  # the Linear's output has negative entries: log gives NaN
        first = w.first_nonfinite()
    assert first == {"phase": "forward", "module": "1", "type": "LogInPlace", "call": 0, "where": "output",
                     "inside": ""}


def test_input_gradient_is_named_before_the_parameter_gradient_of_the_same_node():
    """One node, both gradients non-finite (x and s hold Inf; the output gradient of sum() is finite): the
    gradient sent on to other modules (grad_input) is the event, not the one kept here (grad_param)."""
    model = Scale(float("inf"))
    x = torch.full((2, 4), float("inf"), requires_grad=True)
    with watch(model) as w:
        model(x).sum().backward()
        rep = w.report()
    assert rep["backward"] == {"phase": "backward", "module": "", "type": "Scale", "call": 0,
                               "where": "grad_input", "inside": None}


def test_the_earliest_event_across_devices_wins():
    """Each device keeps its own (seq, code) flag pair; the report is the event of smallest seq over all
    of them, whatever the order the devices are read in. White-box (CPU only): a second device's pair is
    simulated by moving the first event's pair under another key."""
    model = mlp_with(nn.ReLU())
    nan = torch.tensor([float("nan")])
    with watch(model) as w:
        w._record("forward", [nan], 4, 0, 0, 0)  # seq 0: module number 4, "3" (Tanh), output
        early = w._flags["forward"].pop(torch.device("cpu"))
        w._record("forward", [nan], 2, 0, 0, 0)  # seq 1: module number 2, "1" (ReLU), on the CPU pair
        w._flags["forward"]["other device"] = early  # read after the CPU pair
        first = w.first_nonfinite()
    assert first == {"phase": "forward", "module": "3", "type": "Tanh", "call": 0, "where": "output",
                     "inside": ""}


@pytest.mark.parametrize("nested", [False, True])
def test_a_parameter_held_by_a_module_with_children_is_checked_in_backward(nested):
    """Only leaf modules' parameters were reached (through their boundary nodes), so a non-finite gradient
    of a parameter that a module with children holds itself (a ViT's pos_embed, a LayerScale gain in a
    block's forward) went unnamed: the report said nothing while the optimizer received a NaN/Inf."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), OwnGain()) if nested else OwnGain()
    gain = model[1].gain if nested else model.gain
    with watch(model) as w:
        out = model(torch.randn(8, 4))
        assert w.report()["forward"] is None
        out.sum().backward()
        rep = w.report()
    assert not torch.isfinite(gain.grad).all()  # the test really produced a bad gradient
    assert rep["backward"] == {"phase": "backward", "module": "1" if nested else "", "type": "OwnGain",
                               "call": 0, "where": "grad_param", "inside": "" if nested else None}
    assert all_hooks_empty(model)


def test_a_bad_gradient_from_a_child_is_named_before_the_parents_own_parameter():
    """The parameter hook fires after the module's children have sent their gradients, so when a child
    made the NaN (here ``Sqrt`` at 0, which also reaches the gain), the child is named, not the gain."""
    class Both(nn.Module):
        def __init__(self):
            super().__init__()
            self.clip, self.sqrt = ClipZero(), Sqrt()
            self.gain = nn.Parameter(torch.ones(4))

        def forward(self, x):
            return self.sqrt(self.clip(x * self.gain))

    model = Both()
    with watch(model) as w:
        model(torch.randn(64, 4)).sum().backward()
        rep = w.report()
    assert not torch.isfinite(model.gain.grad).all()
    assert rep["backward"]["module"] == "sqrt" and rep["backward"]["where"] == "grad_input"


class CausalLM(nn.Module):
    """torch's own encoder with its own float causal mask (-Inf above the diagonal), as tutorials write it."""

    def __init__(self, T: int = 5, D: int = 8):
        super().__init__()
        torch.manual_seed(0)
        self.T = T
        layer = nn.TransformerEncoderLayer(D, 2, 16, dropout=0.0, batch_first=True)
        self.enc = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
        self.head = nn.Linear(D, 1)

    def forward(self, x):
        mask = nn.Transformer.generate_square_subsequent_mask(self.T)
        return self.head(self.enc(x, mask=mask, is_causal=True))


def test_infs_false_ignores_a_float_attention_mask_and_still_names_the_nan():
    """A -Inf mask is non-finite by design: under the default it is the first event of a clean step, and
    only the first is kept, so a real NaN went unreported (an audit, 2026-11-26). With ``infs=False`` only
    NaN counts: a clean step reports nothing and a NaN made in the second layer is named there."""
    model, x = CausalLM(), torch.randn(2, 5, 8)
    with watch(model) as w:
        model(x).sum().backward()
        assert w.report()["forward"]["where"] == "input"  # the mask, documented: infs=True counts -Inf
    with watch(model, infs=False) as w:
        model(x).sum().backward()
        assert w.report() == {"forward": None, "backward": None}
        w.reset()
        with torch.no_grad():
            model.enc.layers[1].linear2.weight[0, 0] = float("nan")
        model(x).sum().backward()
        assert w.report()["forward"]["module"] == "enc.layers.1.linear2"


def test_nan_only_check_on_complex_empty_and_inf_tensors():
    class Out(nn.Module):
        def __init__(self, value):
            super().__init__()
            self.value = value

        def forward(self, x):
            return {"inf": x * float("inf"), "empty": x[:0], "c": torch.complex(x, x * self.value)}

    for value, expected in ((1.0, None), (float("nan"), "1")):
        model = nn.Sequential(nn.Linear(3, 3), Out(value))
        with watch(model, infs=False) as w:
            model(torch.randn(2, 3))
            got = w.first_nonfinite()
            assert (got["module"] if got else None) == expected


@dataclasses.dataclass
class Pair:
    logits: torch.Tensor
    aux: torch.Tensor | None = None


class DataclassOut(nn.Module):
    def forward(self, x):
        return Pair(x, torch.log(-x.abs() - 1))


class Float8Out(nn.Module):
    def forward(self, x):
        return (x * float("inf")).to(torch.float8_e5m2)


def test_dataclass_float8_and_meta_outputs():
    """Audit, 2026-11-26: a NaN inside a dataclass output was blamed on the module that received it; a
    float8 output raised inside the hook (no subtraction for float8 on CPU), breaking the model's forward;
    a model on the meta device raised when the result was read."""
    model = nn.Sequential(nn.Linear(3, 3), DataclassOut())
    with watch(model) as w:
        model(torch.randn(2, 3))
        assert (w.first_nonfinite()["module"], w.first_nonfinite()["where"]) == ("1", "output")
    model = nn.Sequential(nn.Linear(3, 3), Float8Out())
    with watch(model) as w:
        model(torch.randn(2, 3))
        assert w.first_nonfinite()["module"] == "1"
    with torch.device("meta"):
        meta = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 1))
    with watch(meta) as w:
        meta(torch.randn(2, 3, device="meta")).sum()
        assert w.report() == {"forward": None, "backward": None}


@pytest.mark.parametrize("infs", [True, False])
def test_large_tensors_are_checked_exactly_in_one_pass(infs):
    """From _MINMAX_FROM entries a tensor is checked with aminmax (no temporary of its size): NaN and ±Inf
    found wherever they sit, and finite extremes of both signs (whose lo + hi would overflow) are no event."""
    from nonans_optim.watch import _MINMAX_FROM, _nonfinite_by_device

    n = _MINMAX_FROM + 5
    cpu = torch.device("cpu")
    for value, pos, expected in ((float("nan"), 0, True), (float("nan"), n - 1, True), (float("inf"), 7, infs),
                                 (float("-inf"), n - 1, infs), (3e38, 3, False)):
        t = torch.randn(n)
        t[pos] = value
        if value == 3e38:
            t[pos + 1] = 3e38  # lo + hi, hi + hi would be Inf: the check must not add them
            t[pos + 2] = -3e38
        assert bool(_nonfinite_by_device([t, torch.randn(3)], infs)[cpu]) == expected, (value, pos)
        assert bool(_nonfinite_by_device([t.bfloat16()], infs)[cpu]) == (expected and value != 3e38)
