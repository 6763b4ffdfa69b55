"""Studies as Hydra multiruns (issue 31): the same small Figure-11 study under the basic launcher (killed after its
first job, then resumed), under joblib with 2 jobs and under submitit_local gives the same report; the report
logs its tables to the multirun's wandb group (offline files read back)."""

from __future__ import annotations

import json
import os
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

import pytest

from engine.report import build, markdown_tables

ROOT = Path(__file__).resolve().parents[1]
STUDY = ["+experiment=fig11", "model=deepseek_v2_lite", "batch_size=2,4,8", "prompt_len=16", "gen_len=3",
         "study.systems=[presched,fiddler]", "study.machines=[v100_pcie3]"]


def multirun(folder: Path, *extra: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "engine.simulate", "-m", *STUDY, f"hydra.sweep.dir={folder}",
                             *extra], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


def finish(proc: subprocess.Popen) -> str:
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, out[-3000:]
    return out


def done_jobs(folder: Path) -> dict[str, int]:
    """Job folder -> the inode of its results.json, for every job that finished."""
    return {p.parent.name: (p.parent / "results.json").stat().st_ino for p in folder.glob("*/job_complete.json")}


@pytest.fixture(scope="module")
def basic(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, dict[str, int], str]]:
    """The study under the basic launcher, killed (SIGKILL, the whole process group) once its first job is done,
    then rerun in the same folder: (folder, the jobs done before the kill, the rerun's log)."""
    folder = tmp_path_factory.mktemp("basic")
    proc = multirun(folder, "hydra/launcher=basic", "wandb.mode=offline")
    deadline = time.monotonic() + 300
    while not done_jobs(folder) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.communicate()
    before = done_jobs(folder)
    log = finish(multirun(folder, "hydra/launcher=basic", "wandb.mode=offline"))
    yield folder, before, log


def test_a_killed_multirun_resumes_without_redoing_its_finished_jobs(basic: tuple[Path, dict[str, int], str]) -> None:
    folder, before, log = basic
    assert 1 <= len(before) < 3, f"the kill came after {len(before)} of 3 jobs"
    after = done_jobs(folder)
    assert sorted(after) == ["0", "1", "2"]
    assert {job: after[job] for job in before} == before  # the same results files: not rewritten
    assert log.count("complete in") == len(before)  # the rerun said which it skipped


def test_basic_and_joblib_with_two_jobs_give_identical_tables(basic: tuple[Path, dict[str, int], str],
                                                              tmp_path: Path) -> None:
    finish(multirun(tmp_path, "hydra/launcher=joblib", "hydra.launcher.n_jobs=2", "wandb.mode=disabled"))
    tables = [markdown_tables(build(folder, tmp_path / name).read_text()) for folder, name in
              ((basic[0], "basic_report"), (tmp_path, "joblib_report"))]
    assert tables[0] == tables[1]
    throughput = tables[0]["throughput_tokens_s"]
    assert throughput[0] == ["system", "b=2", "b=4", "b=8"] and {r[0] for r in throughput[1]} == {"LayerScope", "Fiddler"}


def test_report_reads_a_folder_submitit_local_wrote(basic: tuple[Path, dict[str, int], str], tmp_path: Path) -> None:
    finish(multirun(tmp_path, "hydra/launcher=submitit_local", "hydra.launcher.timeout_min=10",
                    "wandb.mode=disabled"))
    assert (tmp_path / ".submitit").is_dir()  # submitit's own files beside the jobs' folders
    ours, theirs = (markdown_tables(build(f, tmp_path / f"report_{i}").read_text())
                    for i, f in enumerate((basic[0], tmp_path)))
    assert theirs == ours


def wandb_records(path: Path) -> Iterator[object]:
    """The records of a wandb transaction log (`run-<id>.wandb`), decoded with wandb's own protobuf schema.

    wandb >= 0.2x has no Python reader any more (wandb-core writes the file): the log is LevelDB's format (7-byte
    header ':W&B', magic 0xBEE1, version; 32 KiB blocks of records: crc32, length, type full/first/middle/last)."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B" and struct.unpack("<H", data[4:6])[0] == 0xBEE1, f"{path}: not a wandb log"
    pos, block, pending = 7, 32768, b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if length == 0 and kind == 0:
            break
        pending += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # full, last
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


def test_the_report_logs_its_tables_to_the_multiruns_wandb_group(basic: tuple[Path, dict[str, int], str]) -> None:
    folder = basic[0]
    groups = {json.loads(p.read_text())["group"] for p in folder.glob("*/wandb.json")}
    assert groups == {f"simulate/{folder.name}"}  # every job a run of one group
    report = build(folder, folder / "report", wandb_mode=None)  # the jobs' mode: offline
    expected = set(markdown_tables(report.read_text())) | {"runs", "fig11_throughput"}
    [log] = (folder / "report").glob("wandb/offline-run-*/run-*.wandb")
    keys, groups, kinds = set(), set(), []
    for record in wandb_records(log):
        kind = record.WhichOneof("record_type")
        kinds.append(kind)
        if kind == "run":
            groups.add(record.run.run_group)
        elif kind == "history":  # a logged table or image: its key's `_type` item
            keys |= {item.nested_key[0] for item in record.history.item if list(item.nested_key[1:]) == ["_type"]
                     and json.loads(item.value_json) in ("table-file", "image-file")}
    assert groups == {f"simulate/{folder.name}"}, (groups, kinds, log.stat().st_size)
    assert expected <= keys, expected - keys


def test_the_regimes_study_sweeps_every_regime_by_a_name_that_finds_it() -> None:
    from omegaconf import OmegaConf

    from engine.bench.bench_presched_regimes import REGIMES, regime_named

    params = OmegaConf.load(ROOT / "conf/experiment/presched_regimes.yaml").hydra.sweeper.params
    names = str(params["study.regime"]).split(",")
    assert names == [r.name for r in REGIMES] and [regime_named(n) for n in names] == REGIMES
    with pytest.raises(ValueError, match="study.regime: 'nope'"):
        regime_named("nope")


def test_config_schemas_pickle_by_reference_for_launchers_that_ship_them_to_workers() -> None:
    """joblib / submitit / Ray pickle Hydra's config store to their workers: an `unfrozen` schema must arrive as
    the same class, or its fields' dataclasses.MISSING defaults arrive as copies and composing fails there."""
    import pickle

    import cloudpickle

    from core.config import unfrozen
    from schedulers.hardware import HardwareProfile

    schema = unfrozen(HardwareProfile)
    assert pickle.loads(cloudpickle.dumps(schema)) is schema and pickle.loads(pickle.dumps(schema)) is schema
