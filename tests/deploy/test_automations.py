"""automations.yaml checked against Prefect's own automation schema and quarry's flows."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from prefect.client.schemas.objects import StateType
from prefect.events.actions import ChangeFlowRunState
from prefect.events.schemas.automations import AutomationCore, EventTrigger, Posture
from prefect.settings import get_current_settings

from tests.deploy.test_prefect_yaml import DEPLOYMENTS

ROOT = Path(__file__).resolve().parents[2]


def automations() -> list[AutomationCore]:
    data: dict[str, Any] = yaml.safe_load((ROOT / "automations.yaml").read_text())
    # As `prefect automation create --from-file` reads it.
    return [AutomationCore.model_validate(item) for item in data["automations"]]


def test_unresponsive_runs_of_quarrys_flows_are_marked_crashed() -> None:
    [crash] = [a for a in automations() if a.name == "quarry-crash-unresponsive-runs"]
    trigger = crash.trigger
    assert isinstance(trigger, EventTrigger) and trigger.posture == Posture.Proactive
    assert trigger.after == {"prefect.flow-run.heartbeat"}
    # A run that ends any way is not a zombie; one still beating is not either.
    assert trigger.expect >= {
        "prefect.flow-run.heartbeat",
        *(f"prefect.flow-run.{s}" for s in ("Completed", "Failed", "Cancelled", "Crashed")),
    }
    assert trigger.for_each == {"prefect.resource.id"}
    # Only quarry's flows, by the names the deployments run.
    related = trigger.match_related
    assert not isinstance(related, list)
    assert related.get("prefect.resource.role") in ("flow", ["flow"])
    assert set(related.get("prefect.resource.name") or []) == {
        flow_name for _, flow_name in DEPLOYMENTS.values()
    }
    # Several missed heartbeats, not one late one (a busy worker sends them late).
    frequency = get_current_settings().flows.heartbeat_frequency
    assert frequency is not None and trigger.within.total_seconds() >= 3 * frequency
    [action] = crash.actions
    assert isinstance(action, ChangeFlowRunState) and action.state == StateType.CRASHED
    assert crash.enabled
