"""One registry pattern for both modes: a policy is its module (registration discovered, settings it owns) and
its YAML (checked against those settings); unknown names fail in one line naming the config key."""

from __future__ import annotations

import sys
import textwrap
from dataclasses import dataclass

import numpy as np
import pytest
from omegaconf import OmegaConf

import schedulers.offload
import schedulers.serverless
from conf import compose
from engine.serverless.experiments import default_specs
from engine.serverless.policies import SystemSpec, build_policy, slots_per_device
from models.loading import resolve_model_config
from schedulers.base import OFFLOAD, SchedulerSettings, SchedulerSetup, build_scheduler, scheduler_settings
from schedulers.cost import CostModel
from schedulers.ep_placement import SERVERLESS, ReplicaSettings
from schedulers.hardware import load_hardware
from schedulers.registry import Registry

OFFLOAD_POLICY = '''
from dataclasses import dataclass

from schedulers.base import SchedulerSettings, register
from schedulers.policy import OffloadPolicy, by_tokens, gpu_only_plan, split_by_availability


@dataclass(frozen=True)
class ToySettings(SchedulerSettings):
    kind: str = "toy_offload"
    label: str = "Toy"
    depth: int = 2


@register("toy_offload", settings=ToySettings)
class Toy(OffloadPolicy):
    def plan(self, state):
        _, missing = split_by_availability(state)
        return gpu_only_plan(state, by_tokens(missing, state.tokens, descending=True))
'''

SERVERLESS_POLICY = '''
from dataclasses import dataclass

from schedulers.ep_placement import ReplicaSettings, register
from schedulers.serverless.static_ep import StaticEPPolicy


@dataclass(frozen=True)
class ToySettings(ReplicaSettings):
    kind: str = "toy_serverless"
    label: str = "Toy EP"
    spare: int = 3

    def slots_per_device(self, num_experts, num_devices):
        return -(-num_experts // num_devices) + self.spare


@register("toy_serverless", settings=ToySettings)
class ToyEP(StaticEPPolicy):
    pass
'''


@pytest.fixture
def plugin(tmp_path, monkeypatch):
    """Write a policy module into a folder on the policy package's path (no other file touched); the
    registries and sys.modules are restored afterwards."""
    for registry in (OFFLOAD, SERVERLESS):
        registry.names()  # everything shipped is registered before the snapshot
        monkeypatch.setattr(registry, "_entries", dict(registry._entries))
        monkeypatch.setattr(registry, "_imported", set(registry._imported))
    added = []

    def write(package, source: str, module: str) -> None:
        folder = tmp_path / package.__name__.replace(".", "_")
        folder.mkdir(exist_ok=True)
        (folder / f"{module}.py").write_text(textwrap.dedent(source))
        monkeypatch.setattr(package, "__path__", [*package.__path__, str(folder)])
        added.append(f"{package.__name__}.{module}")

    yield write
    for name in added:
        sys.modules.pop(name, None)


def setup() -> SchedulerSetup:
    cfg = resolve_model_config(compose("simulate", ["model=mixtral_8x7b"]).model)
    return SchedulerSetup(num_layers=4, num_experts=8, top_k=2, cache_slots=8,
                          cost=CostModel(cfg, load_hardware("v100_pcie3")))


def test_a_new_offload_policy_module_is_found_by_name(plugin) -> None:
    assert "toy_offload" not in OFFLOAD.names()
    plugin(schedulers.offload, OFFLOAD_POLICY, "toy_policy")
    entry = OFFLOAD.get("toy_offload")  # a miss looks for modules added since
    assert entry.policy.__name__ == "Toy" and entry.settings.__name__ == "ToySettings"
    assert "toy_offload" in OFFLOAD.names()
    settings = scheduler_settings({"kind": "toy_offload", "depth": 5, "hot_table": False})
    assert isinstance(settings, entry.settings) and settings.depth == 5 and settings.label == "Toy"
    sched = build_scheduler(settings, setup())
    assert isinstance(sched, entry.policy) and sched.initial_residency().sum() == 0
    with pytest.raises(ValueError, match=r"^scheduler\.max_window: not a setting of offload policy 'toy_offload'"):
        scheduler_settings({"kind": "toy_offload", "max_window": 2})  # another policy's knob


def test_a_new_serverless_policy_module_is_found_by_name(plugin) -> None:
    plugin(schedulers.serverless, SERVERLESS_POLICY, "toy_policy")
    entry = SERVERLESS.get("toy_serverless")
    settings = SERVERLESS.settings_from({"kind": "toy_serverless", "spare": 1}, where="serverless.policies.toy")
    spec = SystemSpec(settings)
    assert slots_per_device(spec, 8, 4) == 3  # its own rule: ceil(E / G) + spare
    policy = build_policy(spec, 8, 4, 1.0)
    assert isinstance(policy, entry.policy) and policy.name == "Toy EP"
    assert policy.plan(0, np.ones(8), None).num_replicas == 8


@pytest.mark.parametrize("registry, key", [(OFFLOAD, "scheduler.kind"), (SERVERLESS, "systems")])
def test_an_unknown_name_fails_in_one_line_naming_the_key_and_the_known_names(registry, key) -> None:
    with pytest.raises(ValueError) as err:
        registry.get("magic")
    message = str(err.value)
    assert "\n" not in message and message.startswith(f"{key}: 'magic' is not a registered")
    assert all(name in message for name in registry.names())


def test_a_config_node_of_an_unknown_kind_fails_naming_its_key() -> None:
    with pytest.raises(ValueError, match=r"^scheduler\.kind: 'magic' is not a registered offload policy"):
        scheduler_settings({"kind": "magic"})
    with pytest.raises(ValueError, match=r"^serverless\.policies\.x\.kind: 'magic' is not a registered serverless"):
        SERVERLESS.settings_from({"kind": "magic"}, where="serverless.policies.x")


def test_registration_checks_the_settings_it_is_given() -> None:
    registry = Registry("schedulers.offload", what="offload policy", key="scheduler.kind", base=SchedulerSettings)

    @dataclass(frozen=True)
    class Named(SchedulerSettings):
        kind: str = "other"

    class Undecorated(SchedulerSettings):  # inherits the base's fields, `kind` "" included
        pass

    with pytest.raises(TypeError, match="must default to the registered name 'named'"):
        registry.register("named", settings=Named)
    with pytest.raises(TypeError, match="must default to the registered name 'undecorated'"):
        registry.register("undecorated", settings=Undecorated)
    with pytest.raises(TypeError, match="extending SchedulerSettings"):
        registry.register("replica", settings=ReplicaSettings)


@pytest.mark.parametrize("kind", OFFLOAD.names())
def test_every_offload_policy_yaml_is_typed_by_its_own_settings(kind: str) -> None:
    node = compose("simulate", [f"scheduler={kind}"]).scheduler
    entry = OFFLOAD.get(kind)
    assert OmegaConf.get_type(node).__name__ == entry.settings.__name__
    assert type(scheduler_settings(node)) is entry.settings


def test_every_serverless_policy_has_its_settings_in_the_serve_config() -> None:
    sv = compose("serve").serverless
    assert sorted(sv.policies) == SERVERLESS.names()
    specs = default_specs(OmegaConf.to_object(sv), 8, 8)
    assert {kind: type(spec.settings) for kind, spec in specs.items()} == \
        {entry.name: entry.settings for entry in SERVERLESS}


@pytest.mark.parametrize("overrides, key", [
    (["scheduler=presched", "scheduler.prefetch_count=2"], "scheduler.prefetch_count"),  # hybrimoe's knob
    (["scheduler=hybrimoe", "scheduler.max_windw=2"], "scheduler.max_windw"),
])
def test_a_knob_of_another_policy_fails_at_start_naming_the_key(overrides, key) -> None:
    with pytest.raises(Exception, match=key.replace(".", r"\.")):
        compose("simulate", overrides)


def test_a_serverless_knob_of_another_policy_fails_at_start_naming_the_key() -> None:
    with pytest.raises(Exception, match=r"serverless\.policies\.eplb\.cv_threshold"):
        compose("serve", ["serverless.policies.eplb.cv_threshold=0.3"])
