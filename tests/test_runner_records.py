"""Record store, manifest comparison, schema versions, stage selection and sharding: the durable pieces."""

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from prune_audit.errors import PruneAuditError
from prune_audit.records.manifest import differing_fields, read_manifest, write_manifest
from prune_audit.records.schema import RUN_SCHEMA as SCHEMA
from prune_audit.records.schema import SCHEMA_VERSION
from prune_audit.records.stages import parse_stage, record_stage, stage_values
from prune_audit.records.store import RecordStore
from prune_audit.runner.sharding import Shard, parse_shard, shard_questions


def make_row(order, split="random", question_id=None):
    return {
        "question_id": order + 1 if question_id is None else question_id,
        "split": split,
        "task": "pope",
        "image": f"img{order // 6}.jpg",
        "image_id": order // 6,
        "object": "dog",
        "label": "yes",
        "answer": "no",
        "answer_text": "no",
        "references": ["yes"],
        "p_yes": 0.1,
        "p_no": 0.8,
        "p_yes_2way": 0.1 / 0.9,
        "logit_diff": -2.07,
        "confidence": 0.8 / 0.9,
        "correct": False,
        "kept": [1, 2, 3],
        "kept_stages": [[1, 2, 3]],
        "merged_stages": [[]],
        "stage_layers": [0],
        "visual_tokens_avg": 3.0,
        "prefill_tokens": 20,
        "cost_tokens": 20.0,
        "retention": 0.5,
        "retention_stages": [0.5],
        "visible_fraction": 1.0,
        "object_tokens_kept": 2,
        "object_tokens_kept_stages": [2],
        "lost": False,
        "lost_stages": [False],
        "diluted": False,
        "diluted_stages": [False],
        "object_area": 100,
        "evidence_objects": ["dog"],
        "evidence_objects_lost": [False],
        "latency_ms": 1.0,
        "flops": 100,
        "flops_vision": 60,
        "flops_selector": 0,
        "flops_llm": 40,
        "flops_dense": 120,
        "flops_decode_token": 2,
        "kv_bytes": 64,
        "flop_equivalent_tokens": 10.0,
        "latency_vision_ms": 0.2,
        "latency_selection_ms": 0.1,
        "latency_prefill_ms": 0.7,
        "geometry": "{}",
        "order": order,
    }


RUN = {"run_id": "0" * 64, "num_questions": 10}
"""The manifest fields a RecordStore reads."""


def test_parts_resume_and_compaction(tmp_path):
    store = RecordStore(tmp_path, RUN, writer="0")
    store.append([make_row(i) for i in (3, 1)])
    store.append([make_row(i) for i in (0, 2)])
    assert store.done_keys() == {("random", i + 1) for i in range(4)}
    # a stray temporary file from a killed writer is ignored
    (tmp_path / "parts" / ".part-0-x.parquet.123.tmp").write_bytes(b"garbage")
    table = store.compact()
    assert table["order"].to_pylist() == [0, 1, 2, 3]
    assert pq.read_table(tmp_path / "records.parquet").schema.equals(SCHEMA)
    assert store.part_files() == []
    # parts written after compaction are merged into the next read, without duplicates
    store.append([make_row(3), make_row(4)])
    assert store.read()["order"].to_pylist() == [0, 1, 2, 3, 4]


def test_records_readable_without_prune_audit(tmp_path):
    pandas = pytest.importorskip("pandas")
    store = RecordStore(tmp_path, RUN)
    store.append([make_row(0), make_row(1)])
    store.compact()
    frame = pandas.read_parquet(tmp_path / "records.parquet")
    assert list(frame["kept"].iloc[0]) == [1, 2, 3]
    duckdb = pytest.importorskip("duckdb")
    assert duckdb.sql(f"select count(*) from '{tmp_path / 'records.parquet'}'").fetchall()[0][0] == 2
    polars = pytest.importorskip("polars")
    assert polars.read_parquet(tmp_path / "records.parquet").height == 2


def test_manifest_differences_name_nested_fields(tmp_path):
    old = {
        "records_schema": SCHEMA_VERSION,
        "selector": {"name": "e2s", "options": {"lam": 0.1}},
        "budget": 64,
        "seed": 0,
    }
    new = {
        "records_schema": SCHEMA_VERSION,
        "selector": {"name": "e2s", "options": {"lam": 0.2}},
        "budget": 128,
        "seed": 0,
    }
    assert differing_fields(old, new) == ["selector.options.lam", "budget"]
    with pytest.raises(PruneAuditError, match="manifest.json: field 'version' is missing"):
        write_manifest(tmp_path, old)
        read_manifest(tmp_path)
    with pytest.raises(PruneAuditError, match="not a run directory"):
        read_manifest(tmp_path / "nowhere")


def test_shards_partition_questions_by_image():
    class Q:
        def __init__(self, image, n):
            self.image, self.n = image, n

    questions = [Q(f"i{k % 7}", k) for k in range(42)]
    shards = [shard_questions(questions, Shard(i, 3)) for i in range(3)]
    assert sorted(q.n for s in shards for q in s) == list(range(42))
    images = [{q.image for q in s} for s in shards]
    assert not (images[0] & images[1]) and not (images[1] & images[2])
    assert parse_shard("1/4") == Shard(1, 4)
    for bad in ("4/4", "x", "1/0"):
        with pytest.raises(PruneAuditError):
            parse_shard(bad)


@pytest.mark.parametrize("version", [None, 1, 3, 4])
def test_manifest_of_an_older_version_is_refused(tmp_path, version):
    write_manifest(tmp_path, {"records_schema": version} if version else {"version": "0.1.0"})
    with pytest.raises(PruneAuditError, match="written by an older prune-audit.*re-run with this version"):
        read_manifest(tmp_path)


def test_records_without_the_stage_columns_are_refused(tmp_path):
    old = SCHEMA.remove(SCHEMA.get_field_index("lost_stages"))
    row = {key: value for key, value in make_row(0).items() if key != "lost_stages"}
    pq.write_table(pa.Table.from_pylist([row], schema=old), tmp_path / "records.parquet")
    store = RecordStore(tmp_path, RUN)
    for read in (store.read, store.done_keys):
        with pytest.raises(
            PruneAuditError,
            match="lacks column lost_stages: it was written by an older prune-audit or another tool; re-run with this version",
        ):
            read()


def stage_rows():
    """Three stages (layers 0, 2, 3) with the last one empty; one row without a mask."""
    first = make_row(0) | {
        "kept_stages": [[1, 2, 3, 4], [1, 2], []],
        "merged_stages": [[], [], []],
        "stage_layers": [0, 2, 3],
        "retention_stages": [0.8, 0.4, 0.0],
        "object_tokens_kept_stages": [3, 1, 0],
        "lost_stages": [False, False, True],
        "diluted_stages": [False, False, False],
    }
    no_mask = make_row(1) | {
        "kept_stages": [[1, 2, 3, 4], [1, 2], []],
        "merged_stages": [[], [], []],
        "stage_layers": [0, 2, 3],
        "retention_stages": [float("nan")] * 3,
        "object_tokens_kept_stages": [-1] * 3,
        "lost_stages": [None] * 3,
        "diluted": None,
        "diluted_stages": [None] * 3,
    }
    return pa.Table.from_pylist([first, no_mask], schema=SCHEMA)


def test_last_stage_is_the_deepest_that_feeds_kept_or_merged_tokens():
    """A recycling stage that keeps no cell but feeds merged tokens still counts as a stage with tokens."""
    row = make_row(0) | {
        "kept_stages": [[1, 2, 3, 4], [], []],
        "merged_stages": [[], [[5, 6]], []],
        "stage_layers": [0, 2, 3],
        "retention_stages": [0.8, 0.3, 0.0],
        "object_tokens_kept_stages": [3, 1, 0],
        "lost_stages": [False, False, True],
        "diluted_stages": [False, True, False],
    }
    records = pa.Table.from_pylist([row], schema=SCHEMA)
    last = stage_values(records, parse_stage("last"), "test")
    assert last.index.tolist() == [1] and last.diluted.tolist() == [1.0]
    assert record_stage(row["kept_stages"], parse_stage("last"), "test", row["merged_stages"]) == 1
    assert record_stage(row["kept_stages"], parse_stage("last"), "test") == 0  # kept cells alone


def test_stage_choice_first_last_and_index():
    records = stage_rows()
    first = stage_values(records, parse_stage("first"), "test")
    np.testing.assert_array_equal(first.retention[:1], [0.8])
    assert first.layer.tolist() == [0, 0] and first.lost[0] == 0.0 and np.isnan(first.lost[1])
    assert first.diluted[0] == 0.0 and np.isnan(first.diluted[1])
    last = stage_values(records, parse_stage("last"), "test")  # the last stage that keeps tokens
    assert last.index.tolist() == [1, 1] and last.layer.tolist() == [2, 2] and last.retention[0] == 0.4
    literal = stage_values(records, parse_stage("2"), "test")
    assert literal.lost[0] == 1.0 and literal.object_tokens_kept.tolist() == [0, -1]
    assert parse_stage("last").describe(last.layer) == "last (decoder layer 2)"
    with pytest.raises(PruneAuditError, match="--stage 3: .* pass first, last or an index below 3"):
        stage_values(records, parse_stage("3"), "test")
    for bad in ("middle", "-1", "1.5"):
        with pytest.raises(PruneAuditError, match="--stage must be first, last or a stage index"):
            parse_stage(bad)
