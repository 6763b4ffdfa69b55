"""Every YAML file under conf/ composes against its typed schema; bad keys and types fail by name."""

from __future__ import annotations

from pathlib import Path

import pytest
from omegaconf import OmegaConf

import conf
from conf import CONF_DIR, compose

TASKS = sorted(p.stem for p in CONF_DIR.glob("*.yaml") if p.stem != "runs_layout")
GROUP_FILES = sorted(p for p in CONF_DIR.glob("*/*.yaml"))


def _task_using_group(group: str) -> str:
    """A task config whose defaults list names `group`."""
    for task in TASKS:
        defaults = OmegaConf.load(CONF_DIR / f"{task}.yaml").get("defaults", [])
        for entry in defaults:
            if isinstance(entry, dict) or OmegaConf.is_dict(entry):
                keys = [str(k).split("@")[0].replace("override ", "") for k in entry.keys()]
                if group in keys:
                    return task
    raise AssertionError(f"no task config in conf/ uses group {group!r}")


def _overlays(task: str, experiment: str) -> bool:
    try:
        OmegaConf.to_container(compose(task, [f"+experiment={experiment}"]), resolve=True, throw_on_missing=False)
    except Exception:  # noqa: BLE001 - another entry point's keys: not this task's experiment
        return False
    return True


@pytest.mark.parametrize("task", TASKS)
def test_task_config_composes(task: str) -> None:
    cfg = compose(task)
    OmegaConf.to_container(cfg, resolve=True, throw_on_missing=False)


@pytest.mark.parametrize("path", GROUP_FILES, ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_group_file_composes_and_validates(path: Path) -> None:
    group, name = path.parent.name, path.stem
    if group == "schemas":
        pytest.skip("python schemas")
    if group == "experiment":  # a study overlays one entry point's config (`+experiment=<name>`)
        tasks = [task for task in TASKS if _overlays(task, name)]
        assert tasks, f"experiment/{name} composes with no task config in conf/"
        return
    task = _task_using_group(group)
    cfg = compose(task, [f"{group}={name}"])
    node = cfg[group]
    obj = OmegaConf.to_object(node)
    assert obj is not None
    if group == "model":
        from models.config import ModelConfig
        from models.loading import resolve_model_config

        assert isinstance(resolve_model_config(node), ModelConfig)


def test_unknown_key_fails_naming_it() -> None:
    with pytest.raises(Exception, match="batch_sizee"):
        compose("generate", ["batch_sizee=3"])


def test_wrong_type_fails_naming_key() -> None:
    with pytest.raises(Exception, match="batch_size"):
        compose("generate", ["batch_size=many"])


def test_wrong_enum_fails_naming_key() -> None:
    with pytest.raises(Exception, match="wandb.mode"):
        compose("generate", ["wandb.mode=sometimes"])


def test_model_arch_type_error_names_key() -> None:
    with pytest.raises(Exception, match="model.arch.hidden_size"):
        compose("generate", ["model=mixtral_8x7b", "model.arch.hidden_size=wide"])


def test_conf_ships_as_package_data() -> None:
    assert (Path(conf.__file__).parent / "generate.yaml").is_file()
