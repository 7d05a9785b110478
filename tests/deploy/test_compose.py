"""compose.yaml (and the project image it builds) checked without a Docker engine.

The file is validated against the Compose Specification's JSON schema (vendored in
data/, see data/SOURCE.md), interpolated the way Compose does (``${VAR:?err}``,
``${VAR:-default}``, ...), and then held to the invariants of the production stack:
pinned images, TEI's model, ports and fail-closed flags, health checks, GPU
reservations, the cpu profile, required secrets, the internal network, volumes
and start order.
"""

from __future__ import annotations

import json
import re
import tomllib
from pathlib import Path
from typing import Any, NamedTuple

import jsonschema
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
COMPOSE_FILE = ROOT / "compose.yaml"
SCHEMA_FILE = Path(__file__).resolve().parent / "data" / "compose-spec.json"

TEI_REPO = "ghcr.io/huggingface/text-embeddings-inference"
TEI_VERSION = "1.9.3"
EMBED_MODEL = "Qwen/Qwen3-Embedding-0.6B"
RERANK_MODEL = "BAAI/bge-reranker-v2-m3"

# Distinct values, so that a test can tell which secret ended up where.
SECRETS = {
    "QUARRY_QDRANT_API_KEY": "test-qdrant-key",
    "QUARRY_EMBED_API_KEY": "test-embed-key",
    "QUARRY_RERANK_API_KEY": "test-rerank-key",
    "QUARRY_API_KEY": "test-query-api-key",
}

# role -> (GPU service, CPU service, host port, model)
TEI_ROLES = {
    "tei-embed": ("tei-embed", "tei-embed-cpu", 8001, EMBED_MODEL),
    "tei-rerank": ("tei-rerank", "tei-rerank-cpu", 8013, RERANK_MODEL),
}
TEI_SERVICES = [name for gpu, cpu, _, _ in TEI_ROLES.values() for name in (gpu, cpu)]
APP_SERVICES = ("api", "prefect-worker")
PROFILES = ("gpu", "cpu")

# service -> {(host_ip or "", published, target)}: everything compose.yaml may publish.
EXPECTED_PORTS: dict[str, set[tuple[str, int, int]]] = {
    "api": {("", 8080, 8080)},
    "tei-embed": {("127.0.0.1", 8001, 80)},
    "tei-embed-cpu": {("127.0.0.1", 8001, 80)},
    "tei-rerank": {("127.0.0.1", 8013, 80)},
    "tei-rerank-cpu": {("127.0.0.1", 8013, 80)},
    "prefect-server": {("127.0.0.1", 4200, 4200)},
}


# --- Compose interpolation ----------------------------------------------------------------


class MissingVariableError(Exception):
    """A ``${VAR:?message}`` (or ``${VAR?message}``) whose variable is missing."""

    def __init__(self, name: str, message: str) -> None:
        super().__init__(f"{name}: {message}")
        self.name = name


_VARIABLE = re.compile(
    r"\$(?:(?P<escaped>\$)"
    r"|\{(?P<braced>[A-Za-z_][A-Za-z0-9_]*)(?:(?P<op>:?[-?+])(?P<arg>[^{}$]*))?\}"
    r"|(?P<named>[A-Za-z_][A-Za-z0-9_]*)"
    r"|(?P<invalid>))"
)


def interpolate_string(text: str, env: dict[str, str]) -> str:
    """Compose's interpolation of one string (no nested expressions: compose.yaml needs none)."""

    def replace(match: re.Match[str]) -> str:
        if match["escaped"]:
            return "$"
        if match["invalid"] is not None:
            raise ValueError(f"unsupported interpolation in {text!r}")
        name = match["braced"] or match["named"]
        op, arg = match["op"], match["arg"] or ""
        value = env.get(name)
        unset_or_empty = not value
        if op in (":?", "?") and (value is None or (op == ":?" and unset_or_empty)):
            raise MissingVariableError(name, arg)
        if op in (":-", "-") and (value is None or (op == ":-" and unset_or_empty)):
            return arg
        if op in (":+", "+"):
            return arg if (value is not None and (op == "+" or value)) else ""
        return value or ""

    return _VARIABLE.sub(replace, text)


def interpolate(node: Any, env: dict[str, str]) -> Any:
    if isinstance(node, str):
        return interpolate_string(node, env)
    if isinstance(node, list):
        return [interpolate(item, env) for item in node]
    if isinstance(node, dict):
        return {key: interpolate(value, env) for key, value in node.items()}
    return node


def variable_references(node: Any) -> list[tuple[str, str | None]]:
    """Every ``(name, operator)`` referenced anywhere in the (uninterpolated) file."""
    found: list[tuple[str, str | None]] = []
    if isinstance(node, str):
        for match in _VARIABLE.finditer(node):
            if match["braced"] or match["named"]:
                found.append((match["braced"] or match["named"], match["op"]))
    elif isinstance(node, list):
        for item in node:
            found += variable_references(item)
    elif isinstance(node, dict):
        for value in node.values():
            found += variable_references(value)
    return found


# --- helpers ------------------------------------------------------------------------------


def load_raw() -> dict[str, Any]:
    data = yaml.safe_load(COMPOSE_FILE.read_text(encoding="utf-8"))
    assert isinstance(data, dict)
    return data


def load(env: dict[str, str] | None = None) -> dict[str, Any]:
    return interpolate(load_raw(), dict(SECRETS) if env is None else env)


def command_flags(command: list[str]) -> dict[str, str | None]:
    """``["--a", "1", "--b", "--c=2"]`` -> ``{"--a": "1", "--b": None, "--c": "2"}``."""
    assert isinstance(command, list), "use the list form of `command`: it is not re-split"
    flags: dict[str, str | None] = {}
    index = 0
    while index < len(command):
        token = command[index]
        assert token.startswith("--"), f"unexpected positional argument {token!r} in {command}"
        if "=" in token:
            key, value = token.split("=", 1)
            flags[key] = value
            index += 1
        elif index + 1 < len(command) and not command[index + 1].startswith("--"):
            flags[token] = command[index + 1]
            index += 2
        else:
            flags[token] = None
            index += 1
    return flags


def as_list(command: str | list[str]) -> list[str]:
    return command.split() if isinstance(command, str) else list(command)


def environment(service: dict[str, Any]) -> dict[str, Any]:
    env = service.get("environment") or {}
    if isinstance(env, list):
        return dict(item.split("=", 1) if "=" in item else (item, None) for item in env)
    return dict(env)


def networks_of(service: dict[str, Any]) -> dict[str, dict[str, Any]]:
    networks = service.get("networks") or {}
    if isinstance(networks, list):
        return {name: {} for name in networks}
    return {name: (config or {}) for name, config in networks.items()}


def backend_names(name: str, service: dict[str, Any]) -> set[str]:
    """The names a service answers to on the backend network."""
    return {name, *networks_of(service).get("backend", {}).get("aliases", [])}


def active_services(compose: dict[str, Any], profile: str) -> dict[str, dict[str, Any]]:
    return {
        name: service
        for name, service in compose["services"].items()
        if not service.get("profiles") or profile in service["profiles"]
    }


def image_tag(image: str) -> tuple[str, str]:
    repository, _, tag = image.rpartition(":")
    assert repository and "/" not in tag, f"{image!r} has no tag"
    return repository, tag


def gpu_devices(service: dict[str, Any]) -> list[dict[str, Any]]:
    reservations = service.get("deploy", {}).get("resources", {}).get("reservations", {})
    return list(reservations.get("devices", []))


class Mount(NamedTuple):
    source: str
    read_only: bool
    named: bool  # a named volume (not a host path)


def mounts(service: dict[str, Any]) -> dict[str, Mount]:
    """``{target: Mount}`` for the short (``src:dst[:ro]``) and the long volume syntax."""
    found = {}
    for volume in service.get("volumes", []):
        if isinstance(volume, dict):
            source, target = volume.get("source", ""), volume["target"]
            read_only = volume.get("read_only") in (True, "true")
            named = volume["type"] == "volume"
        else:
            source, target, *mode = volume.split(":")
            read_only = "ro" in ",".join(mode).split(",")
            named = not source.startswith((".", "/", "~", "$"))
        found[target] = Mount(source, read_only, named)
    return found


def published_ports(service: dict[str, Any]) -> set[tuple[str, int, int]]:
    ports = set()
    for port in service.get("ports", []):
        assert isinstance(port, dict), "use the long port syntax: it names host_ip explicitly"
        ports.add((port.get("host_ip", ""), int(port["published"]), int(port["target"])))
    return ports


def healthcheck_text(service: dict[str, Any]) -> str:
    test = service["healthcheck"]["test"]
    return test if isinstance(test, str) else " ".join(test)


def project_version() -> str:
    with (ROOT / "pyproject.toml").open("rb") as handle:
        return str(tomllib.load(handle)["project"]["version"])


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return load()


@pytest.fixture(scope="module")
def services(compose: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return compose["services"]


# --- schema ---------------------------------------------------------------------------------


def test_schema_file_is_the_vendored_compose_spec() -> None:
    schema = json.loads(SCHEMA_FILE.read_text(encoding="utf-8"))
    assert schema["title"] == "Compose Specification"
    jsonschema.Draft7Validator.check_schema(schema)


@pytest.mark.parametrize("interpolated", [False, True], ids=["as-written", "interpolated"])
def test_compose_file_matches_the_compose_specification(interpolated: bool) -> None:
    schema = json.loads(SCHEMA_FILE.read_text(encoding="utf-8"))
    document = load() if interpolated else load_raw()
    errors = sorted(
        jsonschema.Draft7Validator(schema).iter_errors(document), key=lambda e: list(e.path)
    )
    assert not errors, "\n".join(f"{list(e.path)}: {e.message}" for e in errors)


def test_expected_services(services: dict[str, dict[str, Any]]) -> None:
    assert set(services) == {
        *TEI_SERVICES,
        "qdrant",
        "prefect-server",
        "prefect-worker",
        "api",
    }


# --- images ---------------------------------------------------------------------------------


def test_every_image_is_pinned_to_an_exact_version(services: dict[str, dict[str, Any]]) -> None:
    for name, service in services.items():
        assert "image" in service, f"{name} has no image"
        image = service["image"]
        if "@sha256:" in image:
            continue
        _, tag = image_tag(image)
        assert tag != "latest" and "latest" not in tag, f"{name}: {image}"
        assert re.search(r"\d+\.\d+\.\d+", tag), f"{name}: {image} is not an exact version"


def test_tei_images_are_one_release_and_the_right_hardware(
    services: dict[str, dict[str, Any]],
) -> None:
    for gpu, cpu, _, _ in TEI_ROLES.values():
        repository, tag = image_tag(services[gpu]["image"])
        assert repository == TEI_REPO
        # A GPU-generation tag of the release: 1.9.3, 86-1.9.3, 89-1.9.3, hopper-1.9.3, ...
        assert re.fullmatch(rf"(?:(?:hopper|turing|\d{{2,3}})-)?{re.escape(TEI_VERSION)}", tag)
        assert not tag.startswith(("cpu", "cuda-")), f"{gpu}: {tag} is not a GPU-generation tag"
        assert image_tag(services[cpu]["image"]) == (TEI_REPO, f"cpu-{TEI_VERSION}")
    gpu_tags = {services[gpu]["image"] for gpu, _, _, _ in TEI_ROLES.values()}
    assert len(gpu_tags) == 1, f"the GPU services disagree on the image: {gpu_tags}"


def test_qdrant_is_at_least_1_16(services: dict[str, dict[str, Any]]) -> None:
    repository, tag = image_tag(services["qdrant"]["image"])
    assert repository == "qdrant/qdrant"
    match = re.fullmatch(r"v(\d+)\.(\d+)\.(\d+)", tag)
    assert match, tag
    assert tuple(int(part) for part in match.groups()) >= (1, 16, 0)


def test_project_image_is_built_here_and_tagged_with_the_project_version(
    services: dict[str, dict[str, Any]],
) -> None:
    for name in APP_SERVICES:
        service = services[name]
        assert service["image"] == f"quarry:{project_version()}", name
        build = service["build"]
        context = build if isinstance(build, str) else build["context"]
        assert (COMPOSE_FILE.parent / context).resolve() == ROOT, name
        dockerfile = "Dockerfile" if isinstance(build, str) else build.get("dockerfile")
        assert (ROOT / (dockerfile or "Dockerfile")).is_file()


def test_prefect_server_image_matches_the_prefect_in_the_project_image(
    services: dict[str, dict[str, Any]],
) -> None:
    repository, tag = image_tag(services["prefect-server"]["image"])
    assert repository == "prefecthq/prefect"
    server_version = tag.split("-python")[0]
    dockerfile = (ROOT / "Dockerfile").read_text(encoding="utf-8")
    match = re.search(r"^ARG PREFECT_VERSION=(\S+)$", dockerfile, re.MULTILINE)
    assert match, "Dockerfile must pin the Prefect client with ARG PREFECT_VERSION=..."
    assert match[1] == server_version


# --- TEI ------------------------------------------------------------------------------------


@pytest.mark.parametrize("role", sorted(TEI_ROLES))
@pytest.mark.parametrize("variant", ["gpu", "cpu"])
def test_tei_model_port_and_fail_closed_flags(
    services: dict[str, dict[str, Any]], role: str, variant: str
) -> None:
    gpu, cpu, host_port, model = TEI_ROLES[role]
    name = gpu if variant == "gpu" else cpu
    service = services[name]
    flags = command_flags(service["command"])

    assert flags.get("--model-id") == model
    if name == "tei-embed-cpu":
        # CPU warm-up holds a max-length input's whole attention matrix: 32768 tokens
        # would take 64 GiB a copy, so the input is capped, which TEI allows only with
        # auto-truncate on; quarry's /embed requests say `truncate: false` instead.
        assert flags.get("--auto-truncate") == "true"
        assert flags.get("--max-batch-tokens") == "8192"
    else:
        # Fail closed: TEI >= 1.9 truncates by default, so it must be turned off.
        assert flags.get("--auto-truncate") == "false"
        assert flags.get("--max-batch-tokens") == "32768"
    # TEI 1.9.3 logs its arguments, the API key among them, at INFO on start.
    log_level = environment(service).get("LOG_LEVEL", "")
    assert "text_embeddings_router=warn" in log_level.split(","), name
    # quarry formats queries itself: no server-side default prompt of any kind.
    assert "--default-prompt" not in flags and "--default-prompt-name" not in flags
    env = environment(service)
    for variable in ("DEFAULT_PROMPT", "DEFAULT_PROMPT_NAME", "AUTO_TRUNCATE"):
        assert variable not in env, f"{name}: {variable} would override the command line"
    assert flags.get("--port", "80") == "80"

    assert published_ports(service) == {("127.0.0.1", host_port, 80)}
    assert "/health" in healthcheck_text(service)
    cache = mounts(service).get("/data")
    assert cache and cache.named and cache.source in load_raw()["volumes"], (
        f"{name} needs a named model-cache volume at /data"
    )


def test_tei_api_keys_are_the_ones_quarry_sends(compose: dict[str, Any]) -> None:
    services = compose["services"]
    for role, env_name in (
        ("tei-embed", "QUARRY_EMBED_API_KEY"),
        ("tei-rerank", "QUARRY_RERANK_API_KEY"),
    ):
        gpu, cpu, _, _ = TEI_ROLES[role]
        for name in (gpu, cpu):
            # From the environment: a secret on the command line is visible in `ps`.
            assert "--api-key" not in command_flags(services[name]["command"]), name
            assert environment(services[name])["API_KEY"] == SECRETS[env_name], name
        for app in APP_SERVICES:
            assert environment(services[app])[env_name] == SECRETS[env_name], app


def test_gpu_services_reserve_an_nvidia_gpu(services: dict[str, dict[str, Any]]) -> None:
    for gpu, cpu, _, _ in TEI_ROLES.values():
        devices = gpu_devices(services[gpu])
        assert devices, f"{gpu} reserves no GPU"
        for device in devices:
            assert device.get("driver") == "nvidia"
            assert "gpu" in device.get("capabilities", [])
            assert ("count" in device) != ("device_ids" in device)
        assert services[gpu]["profiles"] == ["gpu"]
        assert not gpu_devices(services[cpu]), f"{cpu} must run without a GPU"
    for name, service in services.items():
        if name not in TEI_SERVICES:
            assert not gpu_devices(service), f"{name} should not reserve a GPU"


def test_cpu_profile_mirrors_the_gpu_services(services: dict[str, dict[str, Any]]) -> None:
    for role, (gpu, cpu, _, _) in TEI_ROLES.items():
        assert services[cpu]["profiles"] == ["cpu"]
        capped = {"--auto-truncate", "--max-batch-tokens"} if role == "tei-embed" else set()
        same = {k: v for k, v in command_flags(services[gpu]["command"]).items() if k not in capped}
        assert {
            k: v for k, v in command_flags(services[cpu]["command"]).items() if k not in capped
        } == same, "same model and flags (the CPU embedder caps its input)"
        # The CPU service answers to the GPU service's name, so quarry's URLs do not change.
        assert role in backend_names(cpu, services[cpu])


@pytest.mark.parametrize("profile", PROFILES)
def test_each_profile_runs_exactly_one_embedder_and_one_reranker(
    compose: dict[str, Any], profile: str
) -> None:
    active = active_services(compose, profile)
    for role in TEI_ROLES:
        providers = [name for name, svc in active.items() if role in backend_names(name, svc)]
        assert len(providers) == 1, f"profile {profile}: {role} is served by {providers}"
    for host_port in (8001, 8013):
        owners = [
            n for n, s in active.items() if any(p[1] == host_port for p in published_ports(s))
        ]
        assert len(owners) == 1, f"profile {profile}: host port {host_port} claimed by {owners}"
    for name in ("qdrant", "prefect-server", *APP_SERVICES):
        assert name in active, f"{name} must run in every profile"


# --- secrets --------------------------------------------------------------------------------


@pytest.mark.parametrize("secret", sorted(SECRETS))
def test_each_secret_is_required(secret: str) -> None:
    env = {name: value for name, value in SECRETS.items() if name != secret}
    with pytest.raises(MissingVariableError) as raised:
        load(env)
    assert raised.value.name == secret
    with pytest.raises(MissingVariableError):
        load({**env, secret: ""})


def test_secrets_are_only_ever_referenced_as_required() -> None:
    text = COMPOSE_FILE.read_text(encoding="utf-8")
    for secret in SECRETS:
        uses = re.findall(rf"\$\{{?{secret}\b.{{0,2}}", text)
        assert uses, f"{secret} is not used"
        for use in uses:
            assert use == f"${{{secret}:?", f"{secret} must be written ${{{secret}:?...}}: {use!r}"


def test_no_variable_is_silently_empty() -> None:
    for name, op in variable_references(load_raw()):
        assert op in (":?", "?", ":-", "-"), f"${{{name}}} has neither a default nor :?"


def test_secrets_reach_the_services_that_need_them(services: dict[str, dict[str, Any]]) -> None:
    qdrant_env = environment(services["qdrant"])
    assert qdrant_env["QDRANT__SERVICE__API_KEY"] == SECRETS["QUARRY_QDRANT_API_KEY"]
    for app in APP_SERVICES:
        env = environment(services[app])
        assert env["QUARRY_QDRANT_API_KEY"] == SECRETS["QUARRY_QDRANT_API_KEY"], app
    assert environment(services["api"])["QUARRY_API_KEY"] == SECRETS["QUARRY_API_KEY"]
    # The query API must not run with authentication off.
    assert environment(services["api"]).get("QUARRY_API_AUTH", "enabled") == "enabled"


# --- application services -------------------------------------------------------------------


def test_application_environment_points_at_the_stack(services: dict[str, dict[str, Any]]) -> None:
    expected = {
        "QUARRY_EMBED_URL": "http://tei-embed:80",
        "QUARRY_RERANK_URL": "http://tei-rerank:80",
        "QUARRY_QDRANT_URL": "http://qdrant:6333",
        "PREFECT_API_URL": "http://prefect-server:4200/api",
    }
    for app in APP_SERVICES:
        env = environment(services[app])
        for key, value in expected.items():
            assert env.get(key) == value, f"{app}: {key}"


def test_commands(services: dict[str, dict[str, Any]]) -> None:
    api = as_list(services["api"]["command"])
    assert api[:2] == ["quarry", "api"]
    assert command_flags(api[2:]) == {"--host": "0.0.0.0", "--port": "8080"}
    worker = as_list(services["prefect-worker"]["command"])
    assert worker[:3] == ["prefect", "worker", "start"]
    flags = command_flags(worker[3:])
    assert flags.get("--pool") == "quarry"
    assert flags.get("--type") == "process"
    # Each run reinstalls quarry into the worker's environment: one run at a time.
    assert flags.get("--limit") == "1"


@pytest.mark.parametrize("app", APP_SERVICES)
def test_applications_wait_for_healthy_dependencies(compose: dict[str, Any], app: str) -> None:
    depends_on = compose["services"][app]["depends_on"]
    assert isinstance(depends_on, dict), "use the long depends_on form with conditions"
    for target, spec in depends_on.items():
        assert target in compose["services"], f"{app} depends on unknown {target}"
        assert spec["condition"] == "service_healthy", f"{app} -> {target}"
    required = {target for target, spec in depends_on.items() if spec.get("required", True)}
    assert "qdrant" in required
    if app == "prefect-worker":
        assert "prefect-server" in required
    for profile in PROFILES:
        active = active_services(compose, profile)
        assert required <= set(active), f"{app}: a required dependency is off in {profile}"
        # Whatever the profile, the app waits for the embedder and the reranker it uses.
        waited = {t for t in depends_on if t in active}
        for role in TEI_ROLES:
            assert any(role in backend_names(t, active[t]) for t in waited), (
                f"{app} does not wait for {role} in profile {profile}"
            )


def test_every_service_has_a_healthcheck(services: dict[str, dict[str, Any]]) -> None:
    for name, service in services.items():
        check = service.get("healthcheck")
        assert check and not check.get("disable"), f"{name} has no healthcheck"
        test = check["test"]
        assert isinstance(test, list) and test[0] in ("CMD", "CMD-SHELL"), name
        assert check.get("start_period"), f"{name}: give it a start_period"


def test_qdrant_healthcheck_uses_readiness(services: dict[str, dict[str, Any]]) -> None:
    text = healthcheck_text(services["qdrant"])
    assert "/readyz" in text and "6333" in text
    # The Qdrant image has neither curl nor wget.
    assert "curl" not in text and "wget" not in text


def test_prefect_healthcheck_uses_the_api(services: dict[str, dict[str, Any]]) -> None:
    assert "/api/health" in healthcheck_text(services["prefect-server"])


def test_api_healthcheck_asks_the_query_api(services: dict[str, dict[str, Any]]) -> None:
    text = healthcheck_text(services["api"])
    assert "127.0.0.1:8080/healthz" in text
    assert "-f" in text.split() or "-fsS" in text.split(), "an HTTP error must fail the check"


# --- network and ports ----------------------------------------------------------------------


def test_only_the_needed_ports_are_published(services: dict[str, dict[str, Any]]) -> None:
    for name, service in services.items():
        assert published_ports(service) == EXPECTED_PORTS.get(name, set()), name
        assert "expose" not in service, f"{name}: `expose` is not needed on one network"


def test_services_talk_over_an_internal_network(compose: dict[str, Any]) -> None:
    networks = compose["networks"]
    assert networks["backend"]["internal"] is True
    for name, service in compose["services"].items():
        joined = networks_of(service)
        assert "backend" in joined, f"{name} is not on the backend network"
        for network in joined:
            assert network in networks, f"{name}: undeclared network {network}"
        if service.get("ports"):
            # Docker publishes no port on an internal network.
            assert any(not networks[n].get("internal") for n in joined), name
    # The database has no route out and no way in from the host.
    assert set(networks_of(compose["services"]["qdrant"])) == {"backend"}


# --- volumes --------------------------------------------------------------------------------


def test_state_lives_in_named_volumes(compose: dict[str, Any]) -> None:
    declared = set(compose["volumes"])
    services = compose["services"]

    def named_volume_at(name: str, target: str) -> bool:
        mount = mounts(services[name]).get(target)
        return bool(mount and mount.named and mount.source in declared)

    assert named_volume_at("qdrant", "/qdrant/storage")
    assert named_volume_at("qdrant", "/qdrant/snapshots")
    prefect_home = environment(services["prefect-server"]).get("PREFECT_HOME", "/root/.prefect")
    assert named_volume_at("prefect-server", prefect_home), "the Prefect database is not kept"
    for name in TEI_SERVICES:
        assert named_volume_at(name, "/data"), name
    for name, service in services.items():
        for target, mount in mounts(service).items():
            if mount.named:
                assert mount.source in declared, f"{name}: undeclared volume at {target}"


def test_worker_reads_sources_read_only(services: dict[str, dict[str, Any]]) -> None:
    mount = mounts(services["prefect-worker"]).get("/srv/sources")
    assert mount and not mount.named and mount.read_only


# --- the project image ----------------------------------------------------------------------


def dockerfile_instructions() -> list[tuple[str, str]]:
    """``(INSTRUCTION, arguments)`` with continuation lines joined and comments dropped."""
    text = (ROOT / "Dockerfile").read_text(encoding="utf-8")
    logical = re.sub(
        r"\\\n",
        " ",
        "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#")),
    )
    result = []
    for line in logical.splitlines():
        if line.strip():
            instruction, _, arguments = line.strip().partition(" ")
            result.append((instruction.upper(), arguments.strip()))
    return result


def test_dockerfile_installs_the_project_without_the_local_extra() -> None:
    runs = [args for instruction, args in dockerfile_instructions() if instruction == "RUN"]
    installs = [run for run in runs if re.search(r"pip install\b", run)]
    assert installs, "the project is never installed"
    assert any(re.search(r"pip install (?:\S+ )*\.(?:\s|$)", run) for run in installs)
    for run in installs:
        assert "[local" not in run and "torch" not in run.split("&&")[0], run
        assert "sentence-transformers" not in run and "-e " not in run, run


def test_dockerfile_runs_as_a_non_root_user() -> None:
    instructions = dockerfile_instructions()
    last_stage = max(i for i, (instruction, _) in enumerate(instructions) if instruction == "FROM")
    users = [args for instruction, args in instructions[last_stage:] if instruction == "USER"]
    assert users, "the final stage has no USER"
    user = users[-1].split(":")[0]
    assert user not in ("root", "0"), user


def test_dockerignore_keeps_the_context_small() -> None:
    lines = [
        line.strip()
        for line in (ROOT / ".dockerignore").read_text(encoding="utf-8").splitlines()
        if line.strip() and not line.startswith("#")
    ]
    assert lines[0] == "*", "start from an allow-list"
    allowed = {line[1:].rstrip("/") for line in lines if line.startswith("!")}
    assert allowed == {"pyproject.toml", "README.md", "hatch_build.py", "src", "flows"}
    copied = [args for instruction, args in dockerfile_instructions() if instruction == "COPY"]
    for args in copied:
        if "--from=" in args:
            continue
        for source in args.split()[:-1]:
            assert source.rstrip("/") in allowed, f"COPY {source} is excluded by .dockerignore"
