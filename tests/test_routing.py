"""How parameters are routed to the scalar and spectral paths (by shape, module type and name) and grouped
by param_groups. Moved out of tests/test_optimizers.py to keep the files small."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import nonans_optim as no
from optim_infos import make_model, train_steps


def test_routing_sends_embeddings_heads_and_1d_to_scalar_and_convs_to_spectral():
    model = make_model()
    opt = no.SFNorMuon(model.named_parameters())
    train_steps(model, opt, 1)
    assert "momentum_buffer" in opt.state[model.conv.weight]
    assert "momentum_buffer" in opt.state[model.fc1.weight]
    for p in (model.embed.weight, model.head.weight, model.fc1.bias, model.norm.weight):
        assert "exp_avg_sq" in opt.state[p] and "momentum_buffer" not in opt.state[p]
    groups = no.param_groups(model)
    by_path = {g["path"]: set(g["param_names"]) for g in groups if g.get("weight_decay", None) != 0.0}
    assert {"conv.weight", "fc1.weight", "fc2.weight"} == by_path["spectral"]
    assert {"embed.weight", "head.weight"} <= by_path["scalar"]


def test_small_model_keeps_the_routes_the_compiled_tests_rely_on():
    """optim_infos.SmallNet, which the tests that compile use instead of TinyNet: an embedding and a bias on
    the scalar path, a conv kernel and both Linear weights on the spectral path, under both ways of naming."""
    model = make_model(small=True)
    by_path: dict[str, set[str]] = {}
    for g in no.param_groups(model):  # two scalar groups: the embedding, and the bias without weight decay
        by_path.setdefault(g["path"], set()).update(g["param_names"])
    assert by_path == {"spectral": {"conv.weight", "fc1.weight", "fc2.weight"},
                       "scalar": {"embed.weight", "fc2.bias"}}
    opt = no.SFNorMuon(model.named_parameters())
    train_steps(model, opt, 1)
    assert all("momentum_buffer" in opt.state[p] for p in (model.conv.weight, model.fc1.weight, model.fc2.weight))
    assert all("momentum_buffer" not in opt.state[p] for p in (model.embed.weight, model.fc2.bias))


def test_route_sends_thin_matrices_to_scalar_and_matches_whole_name_parts():
    """route() on its own: a matrix with a side shorter than 2 (a one-output head, a 1×n projection) takes
    the scalar path as a vector does — NS5 of a rank-1 matrix is only its sign pattern; a conv kernel is
    (out, in·kh·kw). Names match whole dotted parts: "head", "lm_head", but not "multihead" or "overhead"."""
    from nonans_optim.routing import route
    assert [route(torch.empty(s)) for s in [(1, 8), (8, 1), (2, 8), (4, 1, 3, 3), (4, 1, 1, 1)]] == [
        "scalar", "scalar", "spectral", "spectral", "scalar"]
    w = torch.empty(4, 8)
    assert [route(w, n) for n in ("head.weight", "model.lm_head.weight", "blocks.0.multihead.weight",
                                  "overhead.proj.weight", "embed_tokens.weight")] == [
        "scalar", "scalar", "spectral", "spectral", "scalar"]
    # minGPT's tok_emb/pos_emb (any "<x>_emb" part, or "emb"); not a part that merely contains "emb"
    assert [route(w, n) for n in ("tok_emb.weight", "transformer.pos_emb", "emb.weight", "temb_proj.weight",
                                  "member.weight")] == ["scalar", "scalar", "scalar", "spectral", "spectral"]


def test_param_groups_finds_embeddings_by_type_and_keeps_1d_undecayed():
    """An embedding takes the scalar path by its module type whatever its name — here its tied output
    projection, registered first, gives the shared weight the name "proj.weight", which no pattern matches;
    0-/1-D parameters keep weight_decay 0 when param_groups is given a weight_decay for the others."""
    class LM(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(6, 10, bias=False)
            self.tok = nn.Embedding(10, 6)
            self.mix = nn.Linear(6, 6)
            self.proj.weight = self.tok.weight

    groups = no.param_groups(LM(), weight_decay=0.1)
    assert [(g["path"], g["param_names"], g["weight_decay"]) for g in groups] == [
        ("spectral", ["mix.weight"], 0.1), ("scalar", ["proj.weight"], 0.1), ("scalar", ["mix.bias"], 0.0)]


def test_group_path_override():
    model = make_model()
    opt = no.Muon([{"params": [model.fc1.weight], "path": "scalar"},
                   {"params": [p for n, p in model.named_parameters() if n != "fc1.weight"]}])
    train_steps(model, opt, 1)
    assert "exp_avg" in opt.state[model.fc1.weight]
    with pytest.raises(ValueError, match="path"):
        no.Muon([{"params": [model.fc1.weight], "path": "diagonal"}])


def test_plain_parameters_work():
    model = make_model()
    opt = no.FullFusion(model.parameters())
    train_steps(model, opt, 3)
    assert all(torch.isfinite(p).all() for p in model.parameters())
