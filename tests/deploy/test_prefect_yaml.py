"""prefect.yaml checked against Prefect itself and against the flows it deploys.

The file is parsed with the model `prefect deploy` uses, every step is resolved to
its function and its arguments to that function's signature, every deployment's
entrypoint is imported with Prefect's own loader, and its parameters are validated
against the flow's parameter schema the way the Prefect API does.

The entrypoint tests need ``flows/ingest.py`` and ``flows/reindex.py``; until they
exist those tests fail and say so.
"""

from __future__ import annotations

import importlib
import inspect
import re
import zoneinfo
from pathlib import Path
from typing import Any

import pytest
import yaml
from prefect.cli.deploy._models import (
    DeploymentConfig,
    PrefectYamlModel,
    RawScheduleConfig,
)
from prefect.client.schemas.objects import ConcurrencyLimitStrategy
from prefect.client.schemas.schedules import CronSchedule
from prefect.flows import Flow, load_flow_from_entrypoint
from prefect.utilities.callables import parameter_schema
from prefect.utilities.schema_tools import validate

ROOT = Path(__file__).resolve().parents[2]
PREFECT_FILE = ROOT / "prefect.yaml"

INGEST_ENTRYPOINT = "flows/ingest.py:ingest_flow"
REINDEX_ENTRYPOINT = "flows/reindex.py:reindex_flow"
# deployment -> (entrypoint, flow name). `prefect deployment run FLOW/DEPLOYMENT` and
# docs/operations.md use these names.
DEPLOYMENTS = {
    "ingest-nightly": (INGEST_ENTRYPOINT, "quarry-ingest"),
    "ingest-on-demand": (INGEST_ENTRYPOINT, "quarry-ingest"),
    "reindex": (REINDEX_ENTRYPOINT, "quarry-reindex"),
}
# The flows' parameters that deployments, docs and operators rely on.
INGEST_PARAMETERS = {
    "sources",
    "collection",
    "full_sync",
    "allow_mass_delete",
    "include",
    "exclude",
    "reread",
    "encoding",
    "fail_on_failures",
}
REINDEX_PARAMETERS = {"collection", "from_source", "eval_dataset", "min_ndcg"}
WORK_POOL = "quarry"
GCL_PREFIX = "quarry-ingest-"
SOURCES_MOUNT = "/srv/sources"


def load_prefect_yaml() -> dict[str, Any]:
    data = yaml.safe_load(PREFECT_FILE.read_text(encoding="utf-8"))
    assert isinstance(data, dict)
    return data


@pytest.fixture(scope="module")
def config() -> dict[str, Any]:
    return load_prefect_yaml()


@pytest.fixture(scope="module")
def deployments(config: dict[str, Any]) -> dict[str, dict[str, Any]]:
    found = {deployment["name"]: deployment for deployment in config["deployments"]}
    assert len(found) == len(config["deployments"]), "deployment names must be unique"
    return found


_flows: dict[str, Flow[Any, Any]] = {}


def load_flow(entrypoint: str) -> Flow[Any, Any]:
    """Import the flow the way a worker does, but fail on any import error."""
    if entrypoint not in _flows:
        path, _, function = entrypoint.rpartition(":")
        if not (ROOT / path).is_file():
            pytest.fail(f"{path} does not exist (yet): the flows are written separately")
        flow = load_flow_from_entrypoint(f"{ROOT / path}:{function}", use_placeholder_flow=False)
        assert isinstance(flow, Flow), f"{entrypoint} is not a Prefect flow"
        _flows[entrypoint] = flow
    return _flows[entrypoint]


def schedules_of(deployment: dict[str, Any]) -> list[dict[str, Any]]:
    assert "schedule" not in deployment, "use `schedules` (a list)"
    return list(deployment.get("schedules") or [])


def merged_parameters(deployment: dict[str, Any]) -> list[dict[str, Any]]:
    """The parameters each scheduled run gets (or the deployment's, without schedules)."""
    base = dict(deployment.get("parameters") or {})
    schedules = schedules_of(deployment)
    if not schedules:
        return [base]
    return [{**base, **(schedule.get("parameters") or {})} for schedule in schedules]


def steps(section: list[dict[str, Any]] | None) -> list[tuple[str, dict[str, Any]]]:
    result = []
    for step in section or []:
        assert isinstance(step, dict) and len(step) == 1, f"a step is one mapping: {step}"
        ((name, inputs),) = step.items()
        result.append((name, dict(inputs or {})))
    return result


def step_function(name: str) -> Any:
    module, _, attribute = name.rpartition(".")
    return getattr(importlib.import_module(module), attribute)


# --- the file as Prefect reads it ---------------------------------------------------------


def test_prefect_accepts_the_file(config: dict[str, Any]) -> None:
    model = PrefectYamlModel.model_validate(config)
    assert {deployment.name for deployment in model.deployments} == set(DEPLOYMENTS)


def test_no_unknown_keys(config: dict[str, Any]) -> None:
    # Prefect ignores unknown keys silently, so a typo (`schedule`, `concurrency_limits`)
    # would quietly do nothing. `definitions` is the conventional home of YAML anchors.
    known_top = {field.alias or name for name, field in PrefectYamlModel.model_fields.items()} | {
        "definitions"
    }
    assert set(config) <= known_top, set(config) - known_top
    for deployment in config["deployments"]:
        unknown = set(deployment) - set(DeploymentConfig.model_fields)
        assert not unknown, f"{deployment['name']}: unknown keys {unknown}"


def test_deployments_and_entrypoints(deployments: dict[str, dict[str, Any]]) -> None:
    assert set(deployments) == set(DEPLOYMENTS)
    for name, (entrypoint, _) in DEPLOYMENTS.items():
        assert deployments[name]["entrypoint"] == entrypoint, name


def test_every_deployment_runs_in_the_quarry_pool(deployments: dict[str, dict[str, Any]]) -> None:
    for name, deployment in deployments.items():
        assert deployment["work_pool"]["name"] == WORK_POOL, name


def test_the_worker_pool_is_a_process_pool() -> None:
    compose = yaml.safe_load((ROOT / "compose.yaml").read_text(encoding="utf-8"))
    command = compose["services"]["prefect-worker"]["command"]
    assert command[:3] == ["prefect", "worker", "start"]
    assert command[command.index("--pool") + 1] == WORK_POOL
    assert command[command.index("--type") + 1] == "process"


# --- schedules ----------------------------------------------------------------------------


def test_nightly_schedule(deployments: dict[str, dict[str, Any]]) -> None:
    (schedule,) = schedules_of(deployments["ingest-nightly"])
    RawScheduleConfig.model_validate(schedule)  # what `prefect deploy` accepts (no typos)
    assert schedule["cron"] == "0 2 * * *"
    timezone = schedule.get("timezone")
    assert timezone, "give the schedule an explicit timezone"
    zoneinfo.ZoneInfo(timezone)  # a real IANA name
    CronSchedule(cron=schedule["cron"], timezone=timezone)
    assert schedule.get("active", True) is True


@pytest.mark.parametrize("name", ["ingest-on-demand", "reindex"])
def test_ad_hoc_deployments_have_no_schedule(
    deployments: dict[str, dict[str, Any]], name: str
) -> None:
    assert schedules_of(deployments[name]) == []


# --- one writer per collection ------------------------------------------------------------


def test_the_collection_lock_is_created_at_deploy_time(config: dict[str, Any]) -> None:
    scripts = [
        inputs["script"]
        for name, inputs in steps(config.get("build"))
        if name == "prefect.deployments.steps.run_shell_script"
    ]
    creates = [s for s in scripts if re.search(rf"prefect gcl create \S*{GCL_PREFIX}", s)]
    assert creates, f"no build step creates the {GCL_PREFIX}<collection> limit"
    for script in creates:
        assert re.search(r"--limit 1\b", script), "one writer per collection: --limit 1"
        # Idempotent: a second `prefect deploy` must not fail on the existing limit.
        assert re.search(rf"prefect gcl inspect \S*{GCL_PREFIX}\S* .*\|\|", script), script


def test_deployment_concurrency_limits(deployments: dict[str, dict[str, Any]]) -> None:
    strategies = {strategy.value for strategy in ConcurrencyLimitStrategy}
    nightly = deployments["ingest-nightly"]["concurrency_limit"]
    assert nightly["limit"] == 1
    assert nightly["collision_strategy"] in strategies
    for name, deployment in deployments.items():
        limit = deployment.get("concurrency_limit")
        if isinstance(limit, dict) and "collision_strategy" in limit:
            assert limit["collision_strategy"] in strategies, name


# --- pull steps ---------------------------------------------------------------------------


def test_steps_resolve_to_functions_that_take_their_arguments(config: dict[str, Any]) -> None:
    sections = [config.get("build"), config.get("push"), config.get("pull")]
    sections += [d.get(key) for d in config["deployments"] for key in ("build", "push", "pull")]
    for section in sections:
        for name, inputs in steps(section):
            function = step_function(name)
            accepted = set(inspect.signature(function).parameters)
            arguments = set(inputs) - {"id", "requires"}
            assert arguments <= accepted, f"{name} does not take {arguments - accepted}"


def test_pull_steps_check_out_and_install_the_code(config: dict[str, Any]) -> None:
    pull = steps(config["pull"])
    names = [name for name, _ in pull]
    assert names[0] == "prefect.deployments.steps.git_clone"
    clone = pull[0][1]
    assert re.fullmatch(r"\{\{ \$[A-Z_]+ \}\}", clone["repository"]), (
        "the repository comes from the environment ({{ $VAR }})"
    )
    installs = [
        inputs
        for name, inputs in pull[1:]
        if name
        in (
            "prefect.deployments.steps.run_shell_script",
            "prefect.deployments.steps.pip_install_requirements",
        )
    ]
    assert installs, "the checked-out project is never installed"
    install = installs[0]
    assert install.get("directory") == f"{{{{ {clone['id']}.directory }}}}"
    if "script" in install:
        assert re.search(r"pip install .*(?:\s|^)\.(?:\s|$)", install["script"]), install
        assert "[local" not in install["script"]
    # Every deployment uses these pull steps (none replaces them).
    for deployment in config["deployments"]:
        assert deployment.get("pull") is None, deployment["name"]


# --- flows --------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(DEPLOYMENTS))
def test_entrypoint_imports_the_named_flow(name: str) -> None:
    entrypoint, flow_name = DEPLOYMENTS[name]
    assert load_flow(entrypoint).name == flow_name


def test_flow_signatures() -> None:
    ingest = inspect.signature(load_flow(INGEST_ENTRYPOINT).fn).parameters
    assert set(ingest) >= INGEST_PARAMETERS, INGEST_PARAMETERS - set(ingest)
    assert ingest["sources"].default is inspect.Parameter.empty, "sources is required"
    reindex = inspect.signature(load_flow(REINDEX_ENTRYPOINT).fn).parameters
    assert set(reindex) >= REINDEX_PARAMETERS, REINDEX_PARAMETERS - set(reindex)


@pytest.mark.parametrize("name", sorted(DEPLOYMENTS))
def test_parameters_match_the_flow_signature(
    deployments: dict[str, dict[str, Any]], name: str
) -> None:
    deployment = deployments[name]
    flow = load_flow(deployment["entrypoint"])
    signature = inspect.signature(flow.fn).parameters
    schema = parameter_schema(flow).model_dump_for_openapi()
    for parameters in merged_parameters(deployment):
        unknown = set(parameters) - set(signature)
        assert not unknown, f"{name}: {unknown} are not parameters of {flow.name}"
        # What the Prefect API checks when the deployment is created.
        validate(parameters, schema, raise_on_error=True, ignore_required=True)


@pytest.mark.parametrize("name", ["ingest-nightly", "reindex"])
def test_deployments_that_run_unattended_have_every_required_parameter(
    deployments: dict[str, dict[str, Any]], name: str
) -> None:
    # A scheduled run, or `prefect deployment run quarry-reindex/reindex` with no
    # parameters, must be complete as it stands.
    deployment = deployments[name]
    flow = load_flow(deployment["entrypoint"])
    schema = parameter_schema(flow).model_dump_for_openapi()
    for parameters in merged_parameters(deployment):
        validate(parameters, schema, raise_on_error=True)
        flow.validate_parameters(parameters)


def test_nightly_sources_are_where_the_worker_mounts_them(
    deployments: dict[str, dict[str, Any]],
) -> None:
    compose = yaml.safe_load((ROOT / "compose.yaml").read_text(encoding="utf-8"))
    targets = [
        volume["target"] if isinstance(volume, dict) else volume.rsplit(":", 2)[1]
        for volume in compose["services"]["prefect-worker"]["volumes"]
    ]
    assert SOURCES_MOUNT in targets
    for parameters in merged_parameters(deployments["ingest-nightly"]):
        sources = parameters["sources"]
        assert isinstance(sources, list) and sources
        for source in sources:
            assert source == SOURCES_MOUNT or source.startswith(f"{SOURCES_MOUNT}/"), source


def test_prefect_version_matches_the_images(config: dict[str, Any]) -> None:
    dockerfile = (ROOT / "Dockerfile").read_text(encoding="utf-8")
    match = re.search(r"^ARG PREFECT_VERSION=(\S+)$", dockerfile, re.MULTILINE)
    assert match
    assert str(config["prefect-version"]) == match[1]
