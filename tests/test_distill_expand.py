"""expand: a deeper draft from a finished run computes the run's logits, then trains on.

On the tiny models of test_distill_smoke: a 2-layer run (a few steps, so its weights are not
the initial ones) expanded to 4 layers gives the same logits to float32 rounding (1e-5), keeps
every source layer's weights unchanged at its new index, and ``train --init-from`` moves the
new layers' zeroed projections away from zero.
"""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
from test_distill_smoke import TINY_ARCH, _train_cfg, data  # noqa: F401  (data: fixture)

from edge_client.tools.distill.cli import main as distill_main
from edge_client.tools.distill.expand import ZEROED, layer_plan
from edge_client.tools.distill.model import load_run
from edge_client.tools.distill.train import train

ARCH2 = replace(TINY_ARCH, layers=2)


def test_layer_plan_places_new_layers_after_the_named_ones():
    assert layer_plan(3, [0, 2]) == [0, None, 1, 2, None]
    assert layer_plan(2, [1, 1]) == [0, 1, None, None]
    for bad in ([], [3], [-1]):
        with pytest.raises(ValueError, match="insert-after"):
            layer_plan(3, bad)


@pytest.fixture(scope="module")
def runs(data, tmp_path_factory):  # noqa: F811
    root = tmp_path_factory.mktemp("expand")
    train(_train_cfg(data, root / "src", steps=3, arch=ARCH2))
    assert distill_main(["expand", "--from", str(root / "src"), "--out", str(root / "x4"),
                         "--insert-after", "0", "1"]) == 0
    return root


def test_expanded_run_has_the_source_logits_and_weights(data, runs):  # noqa: F811
    src, vmap = load_run(runs / "src", data["target"])
    big, vmap2 = load_run(runs / "x4", data["target"])
    assert big.config.num_hidden_layers == 4
    assert (vmap2.sub_to_full == vmap.sub_to_full).all()
    saved = json.loads((runs / "x4" / "run.json").read_text())
    assert saved["arch"]["layers"] == 4 and saved["init_from"] == str(runs / "src")
    ids = torch.randint(1, vmap.size, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a, b = src(input_ids=ids).logits, big(input_ids=ids).logits
    assert float(a.abs().max()) > 0.1  # the comparison below is not between two zeros
    assert torch.allclose(a, b, atol=1e-5), float((a - b).abs().max())
    s, x = src.state_dict(), big.state_dict()
    for new, old in ((0, 0), (2, 1)):  # plan [0, new, 1, new]
        for name, w in s.items():
            if name.startswith(f"model.layers.{old}."):
                rest = name[len(f"model.layers.{old}."):]
                assert torch.equal(x[f"model.layers.{new}.{rest}"], w), (new, rest)
    for new in (1, 3):
        for name in ZEROED:
            assert not x[f"model.layers.{new}.{name}"].any(), (new, name)
        # the rest of a new layer is its predecessor's copy, not an empty init
        assert torch.equal(x[f"model.layers.{new}.mlp.up_proj.weight"],
                           x[f"model.layers.{new - 1}.mlp.up_proj.weight"])


def test_training_the_expanded_run_moves_the_new_layers(data, runs):  # noqa: F811
    train(_train_cfg(data, runs / "x4-trained", steps=3, init_from=runs / "x4"))
    model, _ = load_run(runs / "x4-trained", data["target"])
    state = model.state_dict()
    assert json.loads((runs / "x4-trained" / "run.json").read_text())["arch"]["layers"] == 4
    for new in (1, 3):
        for name in ZEROED:
            assert state[f"model.layers.{new}.{name}"].abs().max() > 0, (new, name)


def test_the_card_names_the_expansion_in_the_lineage(data, runs, tmp_path):  # noqa: F811
    from edge_client.tools.distill.export import ExportConfig, export

    if not (runs / "x4-trained" / "ckpt.pt").exists():
        train(_train_cfg(data, runs / "x4-trained", steps=3, init_from=runs / "x4"))
    export(ExportConfig(runs / "x4-trained", tmp_path / "draft", None, data["target"],
                        fp32_out=tmp_path / "fp32", twin_out=tmp_path / "twin",
                        measure_target=False))
    card = (tmp_path / "draft" / "MODEL_CARD.md").read_text()
    rows = [ln for ln in card.splitlines() if ln.startswith(("| train ", "| expand "))]
    assert [r.split("`")[1] for r in rows] == ["src", "x4", "x4-trained"]
    assert rows[1].startswith("| expand `x4` |") and rows[0].startswith("| train `src` |")
