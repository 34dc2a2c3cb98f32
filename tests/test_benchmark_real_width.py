"""``benchmarks/real_width.py``: argument checks, the memory rule, the extrapolation and one tiny run."""

from __future__ import annotations

import json

import pytest

from benchmarks import real_width
from prune_audit.errors import PruneAuditError


@pytest.mark.parametrize(
    "argv",
    [
        ["--family", "llava"],  # not a new family
        ["--family", "internvl", "--selectors", "nonesuch"],
        ["--family", "internvl", "--budgets", "0"],
        ["--family", "internvl", "--decoder-layers", "-2"],
        ["--family", "internvl", "--decoder-layers", "29"],  # InternVL3-8B has 28
        ["--family", "internvl", "--threads", "two"],
        ["--family", "internvl", "--image", "/nonexistent.jpg"],
    ],
)
def test_bad_arguments_exit_2_before_building_anything(argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        real_width.parse_arguments(argv)
    assert exit_info.value.code == 2
    assert "Traceback" not in capsys.readouterr().err


def test_a_model_that_does_not_fit_is_refused_in_one_line():
    with pytest.raises(PruneAuditError, match="pass a smaller --decoder-layers") as error:
        real_width.check_memory(2**50, layers=32)
    assert "\n" not in str(error.value)


def test_extrapolation_adds_the_missing_layers_linearly():
    row = {"ms": 1000.0, "decoder_layer_ms": 600.0, "gflops": 50.0, "gflops_llm": 20.0, "peak_rss_gib": 4.0}
    full = real_width.extrapolate(row, measured_layers=2, real_layers=32, layer_bytes=2**30, in_llm=False)
    assert full == {
        "ms_full_depth": 1000.0 + 30 * 300.0,
        "gflops_full_depth": 50.0 + 30 * 10.0,
        "peak_rss_gib_full_depth": 4.0 + 30.0,
    }
    assert real_width.extrapolate(row, 2, 32, 2**30, in_llm=True) == {}
    assert real_width.extrapolate(row, 32, 32, 2**30, in_llm=False) == {}


def test_real_configs_have_the_released_widths(tmp_path):
    source = real_width.real_checkpoint("qwen2_vl", tmp_path / "qwen2_vl", tiny=False)
    config = real_width.real_config("qwen2_vl", source, decoder_layers=3, tiny=False)
    assert (config.text_config.hidden_size, config.text_config.num_hidden_layers) == (3584, 3)
    assert config.text_config.rope_parameters["mrope_section"] == [16, 24, 24]
    assert config.vision_config.embed_dim == 1280
    # the parameter count on the meta device: Qwen2-VL-7B is 8.29 B at 28 layers
    from transformers import Qwen2VLForConditionalGeneration

    full = real_width.real_config("qwen2_vl", source, decoder_layers=None, tiny=False)
    assert 8.2e9 < real_width.count_parameters(Qwen2VLForConditionalGeneration, full) < 8.4e9


def test_tiny_run_writes_dense_and_pruned_rows(tmp_path, shared_data):
    image = shared_data / "coco" / "tiny_coco_val2017" / "val2017" / "000000017627.jpg"
    if not image.is_file():
        pytest.skip("../shared/data is absent")
    output = tmp_path / "internvl.json"
    lines = []
    result = real_width.main(
        [
            "--family",
            "internvl",
            "--tiny",
            "--threads",
            "1",
            "--budgets",
            "8",
            "--selectors",
            "divprune",
            "fastv",
            "--image",
            str(image),
            "--json",
            str(output),
        ],
        report=lines.append,
    )
    assert json.loads(output.read_text()) == result
    dense, divprune, fastv = result["rows"]
    # the tiny tiling: 3 x 2 tiles of 2 x 2 tokens and the thumbnail
    assert dense["selector"] == "dense" and dense["visual_tokens"] == 28 and dense["kept_tokens"] == 28
    assert divprune["kept_tokens"] == 8 and divprune["gflops"] < dense["gflops"] == divprune["gflops_dense"]
    assert fastv["selector"] == "fastv" and ("refused" in fastv or fastv["ms"] > 0)
    for row in (dense, divprune):
        assert row["ms"] > 0 and 0 < row["decoder_layer_ms"] <= row["ms"] and row["peak_rss_gib"] > 0
        assert "ms_full_depth" not in row  # measured at the (tiny) full depth: nothing extrapolated
    table, summary = lines
    assert "| dense | - | 28 of 28 |" in table and "| fastv | 8 |" in table
    assert "InternVL3-8B: 2 of 2 decoder layers" in summary
