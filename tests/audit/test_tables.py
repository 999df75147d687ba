"""Every column of every table is compared with the raw records; missing, extra and repeated rows are named."""
import json

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from loopbench.audit import contract
from loopbench.harness import evidence
from tests.audit.tamper import failed, edit_table, rewrite_manifest, tampered


ROWS = {  # table -> (row selector, the row's key as the auditor names it)
    "arms": (lambda df: (df["seq"] == 2), "cpu0 seq 2"),
    "pairs": (lambda df: (df["comparison"] == "native_vs_alias_prefix") & (df["pair"] == 1),
              "cpu0 B2C3 native_vs_alias_prefix pair 1"),
    "requests": (lambda df: (df["seq"] == 3) & (df["phase"] == "measured") & (df["request_id"] == "r0001"),
                 "cpu0 seq 3 measured request r0001"),
    "tokens": (lambda df: (df["seq"] == 3) & (df["phase"] == "measured") & (df["request_id"] == "r0001")
               & (df["position"] == 2), "cpu0 seq 3 measured request r0001 position 2"),
}


@pytest.mark.parametrize("table", sorted(ROWS))
def test_every_table_column_is_compared_with_the_raw_records(bundle, table):
    """Each column of one row changed in turn (manifest rewritten): the auditor names column and row."""
    select, where = ROWS[table]
    path = bundle / "tables" / f"{table}.parquet"
    original = path.read_bytes()
    df = pd.read_parquet(path)
    i = int(np.flatnonzero(select(df))[0])
    must_cover = {"arms": {"arm_kv_layout", "arm_prefix_tiles", "arm_cuda_graphs", "work_rows_per_depth",
                           "work_decode_tokens", "kv_blocks_used", "trace_sha256", "warmup_elapsed_s",
                           "measured_start_unix_s", "measured_end_unix_s"},
                  "pairs": {"baseline_seq", "candidate_seq", "first", "ratio"},
                  "requests": {"finish_reason", "num_tokens", "mean_exit_depth"},
                  "tokens": {"token_id", "exit_depth", "point", "comparison", "arm"}}[table]
    assert must_cover <= set(df.columns)
    for col in df.columns:
        changed = df.copy()
        changed[col] = [(tampered(v) if j == i else v) for j, v in enumerate(df[col])]
        evidence.write_table(path, changed)
        rewrite_manifest(bundle)
        text = failed(bundle)
        if col in contract.TABLE_KEYS[table]:
            assert f"{table}.parquet: lacks the row of {where}" in text, (col, text)
        else:
            assert f"{table}.parquet: {col} of {where} is " in text, (col, text)
        path.write_bytes(original)


def test_missing_extra_and_repeated_table_rows_are_named(bundle):
    edit_table(bundle, "requests", lambda df: df[~ROWS["requests"][0](df)])
    edit_table(bundle, "pairs", lambda df: pd.concat([df, df.iloc[[0]]]))
    edit_table(bundle, "arms", lambda df: pd.concat([df, df.iloc[[0]].assign(seq=99)]))
    edit_table(bundle, "arms", lambda df: df.drop(columns=["work_steps"]))
    rewrite_manifest(bundle)
    text = failed(bundle)
    assert "requests.parquet: lacks the row of cpu0 seq 3 measured request r0001" in text
    assert "pairs.parquet: repeats the row of cpu0 B2C3" in text
    assert "arms.parquet: has a row for cpu0 seq 99 that the raw records do not give" in text
    assert "arms.parquet: lacks column 'work_steps'" in text


def test_empty_table_has_every_declared_column_typed(bundle):
    """On a CPU telemetry has no rows; the writer still writes its declared columns, of their declared types."""
    schema = pq.read_schema(bundle / "tables" / "telemetry.parquet")
    declared = {c["name"]: c["type"] for c in contract.FORMAT["tables"]["telemetry"]["columns"]}
    assert {f.name: str(f.type) for f in schema} == {n: t.replace("float64", "double") for n, t in declared.items()}


def test_empty_table_lacking_declared_columns_is_named(bundle):
    """The old CPU telemetry table: no rows and 4 of its 12 columns."""
    evidence.write_table(bundle / "tables" / "telemetry.parquet",
                         pd.DataFrame({c: pd.Series([], dtype="string") for c in ["job", "seq", "arm", "when"]}))
    rewrite_manifest(bundle)
    text = failed(bundle)
    assert "telemetry.parquet: has no rows and lacks the declared column 'power_w'" in text


def test_empty_table_of_wrong_column_type_is_named(bundle):
    table = evidence.empty_table("telemetry")
    i = table.schema.get_field_index("seq")
    evidence.write_table(bundle / "tables" / "telemetry.parquet",
                         table.set_column(i, "seq", pa.array([], type=pa.string())))
    rewrite_manifest(bundle)
    assert "telemetry.parquet: column 'seq' is of arrow type string, the format declares int64" in failed(bundle)


@pytest.mark.parametrize("table, column, cast", [("tokens", "token_id", "int32"), ("arms", "seq", "int32"),
                                                 ("tokens", "exit_depth", "int64"), ("pairs", "ratio", "float32")])
def test_column_of_another_type_of_its_family_is_named(bundle, table, column, cast):
    """Format version 2 checks the declared arrow type exactly: an int64 column cast to int32 is named."""
    edit_table(bundle, table, lambda df: df.astype({column: cast}))
    rewrite_manifest(bundle)
    declared = contract.declared_columns(table)[column]["type"]
    got = {"float32": "float"}.get(cast, cast)
    assert f"{table}.parquet: column {column!r} is of arrow type {got}, the format declares {declared}" \
        in failed(bundle)


def test_version_1_rules_match_column_types_by_family():
    assert contract.column_type_problem("tokens", "token_id", "int32", exact=False) is None
    assert contract.column_type_problem("tokens", "token_id", "int32") is not None
    assert contract.column_type_problem("tokens", "token_id", "int64") is None


def test_columns_of_a_later_version_are_not_asked_of_an_earlier_bundle():
    """Format 3 added arms' wall-clock span and tokens' point / comparison / arm; version 2 has neither."""
    assert contract.columns_since("arms", 2)[:2] == ["measured_start_unix_s", "measured_end_unix_s"]
    assert contract.columns_since("arms", 4) == ["eager_fraction", *contract.FORMAT["telemetry"]["arm_columns"]]
    assert contract.columns_since("tokens", 2) == ["point", "comparison", "arm"]
    assert contract.columns_since("tokens", 3) == [] and contract.columns_since("telemetry", 4) == ["sample", "energy_mj"]


def test_version_3_columns_are_required_from_3_and_named_in_an_earlier_bundle(bundle):
    path = bundle / "tables" / "tokens.parquet"
    original = path.read_bytes()
    edit_table(bundle, "tokens", lambda df: df.drop(columns=["arm"]))
    rewrite_manifest(bundle)
    assert "tokens.parquet: lacks column 'arm'" in failed(bundle)
    path.write_bytes(original)
    manifest = json.loads((bundle / "manifest.json").read_text())
    (bundle / "manifest.json").write_text(json.dumps({**manifest, "format_version": 2}))
    rewrite_manifest(bundle)   # a bundle claiming version 2 with the columns of version 3
    text = failed(bundle)
    assert "arms.parquet: has column 'measured_start_unix_s', which the raw records do not give" in text, text
    assert "tokens.parquet: has column 'point', which the raw records do not give" in text, text
