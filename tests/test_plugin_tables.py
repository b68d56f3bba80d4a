"""The plug-ins leave the default handlers untouched: the tables show only additions."""
import pytest

from fedcore.runtime.course import Course
from tests.conftest import small_cfg


def _tables(course):
    return {t.role: {e: r.name for e, r in t.entries.items()} for t in (course.server_table,
                                                                           course.client_table)}


def test_all_plugins_together_only_add_handlers(tmp_path):
    plain = Course(small_cfg(tmp_path / "plain")).build()
    every = Course(small_cfg(
        tmp_path / "all", model__type="mlp_bn", model__hidden=[8],
        aggregator__robust_rule="trimmed_mean", privacy__dp__mode="local",
        privacy__dp__fraction=0.5, privacy__dp__noise_multiplier=0.1, attack__type="sign_flip",
        attack__clients=[6], personalization__method="finetune",
        personalization__finetune_on="performance_drop")).build()
    before, after = _tables(plain), _tables(every)
    for role in before:
        for event, name in before[role].items():
            assert after[role][event] == name, (role, event)
    assert set(after["client"]) - set(before["client"]) == {"performance_drop"}
    assert set(after["server"]) == set(before["server"])
    assert all(not t.overwritten for t in every.tables)
    assert every.client_table.get("receiving_models").sends == ("updates", "performance_drop")
    summary = every.run()  # and the whole thing runs to its finish
    assert summary["rounds"] == 2 and summary["attackers"] == [6]
    assert "overwritten" not in (tmp_path / "all" / "handlers.txt").read_text()


def test_behaviours_install_once_whether_named_or_switched_on():
    from fedcore.kernel import registry
    cfg = small_cfg(None, extensions=["robust_aggregation"], aggregator__robust_rule="median",
                    privacy__dp__mode="local")
    assert registry.selected_behaviours(cfg) == ["robust_aggregation", "differential_privacy"]
    assert registry.selected_behaviours(small_cfg(None)) == []


def test_plugin_scenarios_load_and_are_complete(tmp_path):
    from pathlib import Path

    from fedcore.kernel.config import load_config
    root = Path(__file__).resolve().parents[1] / "scenarios"
    for name in ("robust_signflip", "robust_drift", "backdoor_normbound", "dp_fraction", "personalization_dirichlet"):
        cfg = load_config(root / f"{name}.yaml", [f"outdir={tmp_path / name}", "verbose=false"])
        course = Course(cfg).build()
        assert course.behaviours and course.check().complete, name


@pytest.mark.parametrize("name", ["differential_privacy", "attack", "personalization"])
def test_an_extension_its_own_keys_switch_off_is_refused(name):
    from fedcore.kernel.errors import ConfigError
    with pytest.raises(ConfigError, match=f"extensions: '{name}' is switched on by its own config keys"):
        Course(small_cfg(None, extensions=[name])).build()


def test_an_extension_listed_and_switched_on_is_installed_once():
    course = Course(small_cfg(None, extensions=["robust_aggregation", "robust_aggregation"],
                              aggregator__robust_rule="median")).build()
    assert course.behaviours == ["robust_aggregation"]
