"""``prunevid+prunevid_llm`` on a tiny LLaVA-OneVision clip with PruneVid's merged tokens (the official output):
the sequence holds the tokens fed in another order than the selection's output order, and the in-LLM stage still
ranks in the groups the input part formed (each output token found by its kind); keep-all equals dense."""

from __future__ import annotations

import pytest
import torch
from tiny_models import QUESTIONS, WORDS, random_image

from prune_audit.models import load_vlm
from prune_audit.models.kinds import input_kinds
from prune_audit.models.llava_onevision import LlavaOnevisionModel
from prune_audit.models.video_sampling import write_video_sampling
from prune_audit.pruners.base import FED_KINDS
from prune_audit.pruners.composed import parse_selector
from prune_audit.pruners.prunevid import TOKEN_GROUPS

TOL = 1e-5
OFFICIAL = ["prunevid.cluster_ratio=0.5"]


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    path = LlavaOnevisionModel.build_tiny(
        tmp_path_factory.mktemp("onevision") / "model", words=[*WORDS, "Is"], image_size=186, text_layers=3, seed=5
    )
    write_video_sampling(path, {"frames": 4})
    return load_vlm(path, device="cpu")


@pytest.fixture(scope="module")
def item(vlm):
    return vlm.prepare_video(vlm.read_clip([random_image(seed, (90, 70)) for seed in range(6)], 2.0), QUESTIONS[0])


def test_the_stage_ranks_in_the_merged_groups_found_by_their_kinds(vlm, item):
    composed, calls = parse_selector("prunevid+prunevid_llm", OFFICIAL), []
    prune = composed.llm.prune

    def recording(stage, signals, state):
        calls.append((signals, state))
        return prune(stage, signals, state)

    object.__setattr__(composed.llm, "prune", recording)
    prefill, selections = vlm.prefill([item], composed, (item.num_visual, 1))
    (signals, state), selection = calls[0], selections[0]
    kinds = input_kinds(selection.sources, selection.kept)  # output order
    alive = signals.alive.tolist()
    assert sorted(alive) == sorted(kinds) and alive != kinds  # the sequence's order is not the output order
    assert state[FED_KINDS].tolist() == kinds  # the prefill hands the kinds beside the groups
    scores = signals.text_probs.float().max(dim=0)[0].max(dim=0)[0]
    expected = []
    for group in selection.llm_state[TOKEN_GROUPS]:
        positions = torch.tensor([alive.index(kinds[int(p)]) for p in group])
        expected += positions[torch.topk(scores[positions], k=int(group.numel() * 0.4)).indices].tolist()
    kept_kinds = [alive[i] for i in sorted(expected)]
    assert sorted(prefill.kept_stages[0][0]) == sorted(k for k in kept_kinds if k >= 0)
    assert len(prefill.kept_stages[0][0]) + len(prefill.merged_stages[0][0]) == len(expected) < len(alive)


def test_keep_all_is_dense(vlm, item):
    dense, _ = vlm.prefill([item], None, None)
    full, _ = vlm.prefill(
        [item], parse_selector("prunevid+prunevid_llm", ["prunevid_llm.alpha=1.0"]), (item.num_visual, 1)
    )
    assert (full.logits - dense.logits).abs().max() <= TOL
