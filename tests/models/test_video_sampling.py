"""A checkpoint's declared clip frame sizes (``video_sampling.json``), read before its weights."""

from __future__ import annotations

import json

import pytest

from prune_audit.errors import PruneAuditError
from prune_audit.models.video_sampling import VIDEO_SAMPLING_FILE, checkpoint_video_sampling, write_video_sampling


def test_a_folder_without_the_file_reads_at_the_defaults_and_a_written_one_reads_back(tmp_path):
    assert checkpoint_video_sampling(tmp_path) == {} and checkpoint_video_sampling("Qwen/Qwen2.5-VL-7B-Instruct") == {}
    write_video_sampling(tmp_path, {"min_pixels": 9216, "total_pixels": 36864})
    assert checkpoint_video_sampling(tmp_path) == {"min_pixels": 9216, "total_pixels": 36864}


@pytest.mark.parametrize(
    "content",
    [
        "not json",
        json.dumps([1]),
        json.dumps({"max_pixels": 5}),
        json.dumps({"min_pixels": 0}),
        json.dumps({"min_pixels": 1.5}),
        json.dumps({"total_pixels": True}),
    ],  # fmt: skip
)
def test_a_bad_file_is_refused_in_one_line_naming_the_fix(tmp_path, content):
    (tmp_path / VIDEO_SAMPLING_FILE).write_text(content)
    with pytest.raises(PruneAuditError) as error:
        checkpoint_video_sampling(tmp_path)
    assert "\n" not in str(error.value) and "min_pixels" in str(error.value)
