"""docker-compose.yml and docker/ are checked by parsing (no Docker engine here).

Values are rendered the way compose interpolates them (``${VAR}``, ``${VAR:-default}``, ``${VAR:?error}``,
nested; ``$$`` is compose's escape for a ``$`` that the container's shell expands), with every setting at its
default and every secret at a sample value: what ``docker compose up`` uses with a .env holding only secrets.
"""

from __future__ import annotations

import configparser
import json
import re
import shlex
import shutil
import subprocess
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path

import pytest
import yaml
from packaging.requirements import Requirement
from packaging.version import Version

from tests.conftest import REPO

COMPOSE_FILE = REPO / "docker-compose.yml"
DOCKERFILE = REPO / "docker" / "Dockerfile"
REQUIREMENTS = REPO / "docker" / "requirements.txt"
LONG_RUNNING = ("postgres", "s3", "mlflow", "ray-head", "ray-worker", "optuna-dashboard")
SECRET_NAME = re.compile(r"PASSWORD|SECRET|TOKEN|KEY|(DB|DATABASE|STORE|STORAGE)\w*_UR[IL]")
"""Names of settings that hold a secret, or a URL with one in it: never a default."""
CREDENTIALS_IN_URL = re.compile(r"://[^\s/@:]+:[^\s/@]+@")


# --------------------------------------------------------------------------- compose interpolation


class MissingSetting(Exception):
    """A ``${VAR:?error}`` / ``${VAR?error}`` whose variable is missing: compose stops with ``error``."""

    def __init__(self, name: str, message: str) -> None:
        super().__init__(f"required variable {name} is missing a value: {message}")
        self.name, self.message = name, message


@dataclass(frozen=True)
class Ref:
    """One ``${name<op>arg}`` (``op`` in "", ":-", "-", ":?", "?", ":+", "+"), or ``$name`` (op "")."""

    name: str
    op: str
    arg: tuple  # parsed tokens (str | Ref) of the default, error message or replacement


def _closing_brace(text: str, start: int) -> int:
    """Index of the ``}`` closing a ``${`` whose body starts at ``start`` (nested ``${...}`` skipped)."""
    depth, i = 1, start
    while i < len(text):
        if text.startswith("$$", i):
            i += 2
            continue
        if text.startswith("${", i):
            depth, i = depth + 1, i + 2
            continue
        if text[i] == "}":
            depth -= 1
            if depth == 0:
                return i
        i += 1
    raise ValueError(f"unclosed ${{ in {text!r}")


def _parse(text: str) -> tuple:
    """``text`` as tokens: literal strings and :class:`Ref`s (``$$`` is a literal ``$``)."""
    tokens: list = []
    literal, i = "", 0
    while i < len(text):
        if text.startswith("$$", i):
            literal, i = literal + "$", i + 2
        elif text.startswith("${", i):
            end = _closing_brace(text, i + 2)
            match = re.fullmatch(r"([A-Za-z_]\w*)(?:(:?[-?+])(.*))?", text[i + 2:end], re.DOTALL)
            assert match, f"compose cannot interpolate ${{{text[i + 2:end]}}}"
            name, op, arg = match.group(1), match.group(2) or "", match.group(3) or ""
            tokens += [literal, Ref(name, op, _parse(arg))]
            literal, i = "", end + 1
        elif match := re.match(r"\$([A-Za-z_]\w*)", text[i:]):
            tokens += [literal, Ref(match.group(1), "", ())]
            literal, i = "", i + match.end()
        else:
            literal, i = literal + text[i], i + 1
    return tuple(token for token in [*tokens, literal] if token != "")


def _render_tokens(tokens: tuple, env: dict[str, str]) -> str:
    out = []
    for token in tokens:
        if isinstance(token, str):
            out.append(token)
            continue
        value, is_set = env.get(token.name, ""), token.name in env
        present = bool(value) if token.op.startswith(":") else is_set
        if token.op == "" or (token.op in (":-", "-") and present):
            out.append(value)
        elif token.op in (":-", "-"):
            out.append(_render_tokens(token.arg, env))
        elif token.op in (":?", "?"):
            if not present:
                raise MissingSetting(token.name, _render_tokens(token.arg, env))
            out.append(value)
        else:  # ":+", "+"
            out.append(_render_tokens(token.arg, env) if present else "")
    return "".join(out)


def _refs(tokens: tuple) -> Iterator[Ref]:
    """Every :class:`Ref` in ``tokens``, nested ones included."""
    for token in tokens:
        if isinstance(token, Ref):
            yield token
            yield from _refs(token.arg)


def _values(node) -> Iterator[str]:
    """Every string value of a parsed YAML tree (compose interpolates values, never keys)."""
    if isinstance(node, dict):
        for value in node.values():
            yield from _values(value)
    elif isinstance(node, list):
        for value in node:
            yield from _values(value)
    elif isinstance(node, str):
        yield node


def _render_tree(node, env: dict[str, str]):
    """The parsed YAML tree with every string value interpolated (raises :class:`MissingSetting`)."""
    if isinstance(node, dict):
        return {key: _render_tree(value, env) for key, value in node.items()}
    if isinstance(node, list):
        return [_render_tree(value, env) for value in node]
    return _render_tokens(_parse(node), env) if isinstance(node, str) else node


def _compose_variables() -> set[str]:
    return {ref.name for value in _values(yaml.safe_load(COMPOSE_FILE.read_text())) for ref in _refs(_parse(value))}


SAMPLE_SECRETS = {name: f"sample-{name.lower().replace('_', '-')}-0123456789"
                  for name in sorted(_compose_variables()) if SECRET_NAME.search(name)}
"""A value for every secret of the compose file (what a filled-in .env gives); the other settings at defaults."""


def _render(text: str, env: dict[str, str] | None = None) -> str:
    """``text`` as compose interpolates it with ``env`` (default :data:`SAMPLE_SECRETS`)."""
    return _render_tokens(_parse(text), SAMPLE_SECRETS if env is None else env)


def _command(service: dict) -> str:
    """The service's command as one string, at its defaults (list forms joined by spaces)."""
    command = service.get("command", "")
    return _render(command if isinstance(command, str) else " ".join(command))


def _env(service: dict) -> dict[str, str]:
    env = service.get("environment", {})
    if isinstance(env, list):
        env = dict(item.split("=", 1) for item in env)
    return {key: str(value) for key, value in env.items()}


def _mounts(service: dict) -> list[tuple[str, str]]:
    """(source, target) of each volume mount, short or long syntax."""
    mounts = []
    for volume in service.get("volumes", []):
        if isinstance(volume, dict):
            mounts.append((volume["source"], volume["target"]))
        else:
            source, target = volume.split(":")[:2]
            mounts.append((source, target))
    return mounts


def _is_bind(source: str) -> bool:
    return source.startswith((".", "/", "~", "$"))


def _size_bytes(size: str) -> int:
    match = re.fullmatch(r"(\d+)\s*([kmg]?)b?", size.strip().lower())
    assert match, f"shm_size={size!r} is not a size like 16gb"
    return int(match.group(1)) * 1024 ** " kmg".index(match.group(2) or " ")


def _shell_scripts(compose: dict) -> list[tuple[str, str]]:
    """(service, script) for every inline script run by `bash -c` / `sh -c`."""
    scripts = []
    for name, service in compose["services"].items():
        entrypoint = service.get("entrypoint") or []
        command = service.get("command") or []
        argv = list(entrypoint) + (list(command) if isinstance(command, list) else shlex.split(command))
        for i, arg in enumerate(argv[:-1]):
            if arg == "-c" and Path(argv[i - 1] if i else "").name in ("bash", "sh"):
                scripts.append((name, argv[i + 1]))
    return scripts


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load(COMPOSE_FILE.read_text())


@pytest.fixture(scope="module")
def services(compose) -> dict:
    return compose["services"]


@pytest.fixture(scope="module")
def dockerfile() -> str:
    return DOCKERFILE.read_text()


def test_postgres_16_init_script_creates_the_mlflow_and_optuna_databases(services):
    postgres = services["postgres"]
    assert postgres["image"].split(":")[1].split(".")[0].startswith("16")
    inits = [(src, dst) for src, dst in _mounts(postgres) if dst.startswith("/docker-entrypoint-initdb.d/")]
    assert inits, "postgres mounts no init script into /docker-entrypoint-initdb.d"
    sql = "\n".join((REPO / src).read_text() for src, _ in inits)
    created = set(re.findall(r"CREATE DATABASE\s+(\w+)", sql, re.IGNORECASE))
    assert {"mlflow", "optuna"} <= created
    # the image would create POSTGRES_DB before the init script runs, and the script would then fail
    assert _env(postgres).get("POSTGRES_DB") not in created
    assert "healthcheck" in postgres


def test_artifact_store_is_a_pinned_maintained_s3_store_not_minio(services):
    image = services["s3"]["image"]
    assert "minio" not in image.lower(), "MinIO's community images are archived"
    _, _, tag = image.partition(":")
    assert tag and tag != "latest", f"pin the artifact store's tag: {image}"
    assert "healthcheck" in services["s3"]


def test_store_identity_and_every_s3_client_use_the_same_keys(compose, services):
    config = services["s3"]["configs"][0]
    assert config["target"] in _command(services["s3"])
    identities = json.loads(_render(compose["configs"][config["source"]]["content"]))["identities"]
    credentials = identities[0]["credentials"][0]
    for client in ("s3-create-bucket", "mlflow"):
        env = _env(services[client])
        assert _render(env["AWS_ACCESS_KEY_ID"]) == credentials["accessKey"], client
        assert _render(env["AWS_SECRET_ACCESS_KEY"]) == credentials["secretKey"], client
        assert env["AWS_SECRET_ACCESS_KEY"].startswith("${"), f"{client}: the S3 secret must come from the environment"


def test_bucket_job_waits_for_a_healthy_store_creates_mlflow_and_runs_once(services):
    job = services["s3-create-bucket"]
    assert job["depends_on"]["s3"]["condition"] == "service_healthy"
    assert job["restart"] == "no"
    assert ":" in job["image"] and not job["image"].endswith(":latest")
    script = _command(job)
    assert re.search(r"create-bucket --bucket mlflow|s3 mb s3://mlflow", script)
    assert "http://s3:8333" in script


def test_mlflow_server_uses_postgres_and_proxied_s3_artifacts(services):
    mlflow = services["mlflow"]
    assert mlflow["image"] == f"ghcr.io/mlflow/mlflow:v{version('mlflow')}", "match the pinned mlflow"
    command = _command(mlflow)
    password = SAMPLE_SECRETS["NAS_DB_PASSWORD"]
    store_uri = _render(_env(mlflow)["MLFLOW_BACKEND_STORE_URI"])
    assert store_uri == f"postgresql+psycopg://nas:{password}@postgres:5432/mlflow"
    assert "--backend-store-uri" not in command, "the store URI holds the password: MLFLOW_BACKEND_STORE_URI, not argv"
    assert "--serve-artifacts" in command and "--artifacts-destination s3://mlflow/" in command
    assert "--default-artifact-root" not in command, "proxied artifacts use the default mlflow-artifacts:/ root"
    assert "--allowed-hosts" in command
    env = _env(mlflow)
    allowed = _render(env["NAS_MLFLOW_ALLOWED_HOSTS"]).split(",")
    assert {"localhost:5000", "mlflow:5000"} <= set(allowed)  # the host and the Ray nodes
    assert env["MLFLOW_S3_ENDPOINT_URL"] == "http://s3:8333"
    assert mlflow["depends_on"]["postgres"]["condition"] == "service_healthy"
    assert mlflow["depends_on"]["s3-create-bucket"]["condition"] == "service_completed_successfully"
    assert any(port.endswith(":5000:5000") for port in mlflow["ports"])


def test_mlflow_basic_auth_variant_is_switched_by_env_and_configured_by_a_mounted_ini(services):
    mlflow = services["mlflow"]
    command, env = _command(mlflow), _env(mlflow)
    assert "--app-name basic-auth" in command and "NAS_MLFLOW_AUTH" in command
    assert _render(env["NAS_MLFLOW_AUTH"]) == "on", "basic auth is on unless .env says NAS_MLFLOW_AUTH=off"
    mounts = dict((dst, src) for src, dst in _mounts(mlflow))
    ini_path = REPO / mounts[env["MLFLOW_AUTH_CONFIG_PATH"]]
    ini = configparser.ConfigParser()
    ini.read(ini_path)
    assert ini["mlflow"]["admin_username"]
    assert "admin_password" not in ini["mlflow"], "the admin password comes from MLFLOW_AUTH_ADMIN_PASSWORD"
    auth_db = ini["mlflow"]["database_uri"].removeprefix("sqlite:///")
    assert any(auth_db.startswith(dst + "/") and not _is_bind(src) for dst, src in mounts.items()), (
        f"the auth database {auth_db} must live on a named volume")
    for var in ("MLFLOW_AUTH_ADMIN_PASSWORD", "MLFLOW_FLASK_SERVER_SECRET_KEY"):
        assert env[var].startswith("${"), f"{var} must come from the environment"


def test_ray_head_workers_and_driver_share_one_build_and_image(services):
    head, worker, driver = services["ray-head"], services["ray-worker"], services["driver"]
    assert head["build"] == worker["build"] == driver["build"]
    assert head["image"] == worker["image"] == driver["image"]
    assert (REPO / head["build"]["context"] / head["build"]["dockerfile"]).resolve() == DOCKERFILE


def test_ray_head_publishes_gcs_dashboard_and_client_ports_and_workers_join_it(services):
    head, worker = services["ray-head"], services["ray-worker"]
    assert _command(head).startswith("ray start --head") and "--block" in _command(head)
    published = {port.rsplit(":", 2)[-1] for port in head["ports"]}
    assert {"6379", "8265", "10001"} <= published
    assert "ray start --address=ray-head:6379 --block" in _command(worker)
    assert worker["depends_on"]["ray-head"]["condition"] == "service_healthy"


def test_ray_workers_reserve_nvidia_gpus_and_enough_shared_memory(services):
    worker = services["ray-worker"]
    devices = worker["deploy"]["resources"]["reservations"]["devices"]
    assert any(d["driver"] == "nvidia" and "gpu" in d["capabilities"] for d in devices)
    assert re.fullmatch(r"\$\{\w+:-\d+\}", str(worker["deploy"]["replicas"])), "replicas: ${VAR:-N}"
    for name in ("ray-worker", "ray-head"):
        assert _size_bytes(_render(services[name]["shm_size"])) >= 8 * 1024 ** 3, name


def test_ray_nodes_and_driver_share_the_cluster_token_and_tracking_server(services):
    envs = [_env(services[name]) for name in ("ray-head", "ray-worker", "driver")]
    assert all(env == envs[0] for env in envs)
    assert envs[0]["RAY_AUTH_MODE"] == "token" and envs[0]["RAY_AUTH_TOKEN"].startswith("${")
    assert envs[0]["MLFLOW_TRACKING_URI"] == "http://mlflow:5000"
    mounts = [dict((dst, src) for src, dst in _mounts(services[name])) for name in ("ray-head", "ray-worker", "driver")]
    assert all(m == mounts[0] for m in mounts), "every node must see the same nas_runs and data paths"


def test_optuna_dashboard_is_pinned_and_reads_the_optuna_database_from_its_config_file(compose, services):
    dashboard = services["optuna-dashboard"]
    assert re.fullmatch(r"ghcr\.io/optuna/optuna-dashboard:v\d+\.\d+\.\d+", dashboard["image"])
    assert Version(dashboard["image"].rsplit(":v", 1)[1]) >= Version("0.20"), "--from-config came in 0.20.0"
    match = re.fullmatch(r"--from-config (\S+)", _command(dashboard))
    assert match, f"optuna-dashboard's storage URL must come from its config file, not argv: {_command(dashboard)}"
    (config,) = [c for c in dashboard["configs"] if c["target"] == match.group(1)]
    toml = tomllib.loads(_render(compose["configs"][config["source"]]["content"]))
    password = SAMPLE_SECRETS["NAS_DB_PASSWORD"]
    assert toml["optuna_dashboard"]["storage"] == f"postgresql+psycopg2://nas:{password}@postgres:5432/optuna"
    assert any(port.endswith(":8080:8080") for port in dashboard["ports"])
    assert dashboard["depends_on"]["postgres"]["condition"] == "service_healthy"


def test_long_running_services_restart_and_have_healthchecks_one_shots_do_not_restart(services):
    for name in LONG_RUNNING:
        assert services[name]["restart"] == "unless-stopped", name
        if name != "ray-worker":  # a worker's health is the head's `ray status`
            assert "healthcheck" in services[name], name
    for name in set(services) - set(LONG_RUNNING):
        assert services[name]["restart"] == "no", name


def test_every_named_volume_is_declared_and_every_mounted_file_exists(compose, services):
    for name, service in services.items():
        for source, target in _mounts(service):
            if _is_bind(source):
                assert (REPO / source).is_file(), f"{name} mounts a missing file {source}"
            else:
                assert source in compose["volumes"], f"{name} mounts an undeclared volume {source}"
        for config in service.get("configs", []):
            assert config["source"] in compose.get("configs", {}), f"{name}: undeclared config {config['source']}"


def test_every_depends_on_target_exists(services):
    for name, service in services.items():
        for target in service.get("depends_on", {}):
            assert target in services, f"{name} depends on a missing service {target}"


def test_database_passwords_come_from_the_environment(compose):
    text = COMPOSE_FILE.read_text()
    uris = re.findall(r"postgresql\+\w+://nas:([^@]+)@", text)
    assert uris
    for password in uris:
        assert password.startswith(("${", "$${")), f"a literal password in a database URL: {password}"
    for service in compose["services"].values():
        for key, value in _env(service).items():
            if re.search(r"PASSWORD|SECRET|TOKEN", key) and "TRACKING" not in key:
                assert value.startswith("${"), f"{key} is set literally"


def _argv_texts(service: dict) -> list[str]:
    """What a service runs as argv (command, entrypoint, healthcheck), each as one string as written."""
    texts = []
    for argv in (service.get("command"), service.get("entrypoint"), (service.get("healthcheck") or {}).get("test")):
        if argv:
            texts.append(argv if isinstance(argv, str) else " ".join(argv))
    return texts


def test_no_command_line_carries_a_secret(services):
    """argv is world-readable (``ps``, /proc/<pid>/cmdline, ``docker inspect``'s Args): no secret on it, neither
    filled in by compose (``${NAS_DB_PASSWORD}``) nor by the container's shell (``$${NAS_DB_PASSWORD}``, or a
    variable whose value holds one, such as a database URL)."""
    for name, service in services.items():
        env = _env(service)
        secret_env = {key for key, value in env.items()
                      if SECRET_NAME.search(key) or any(s in _render(value) for s in SAMPLE_SECRETS.values())}
        for text in _argv_texts(service):
            rendered = _render(text)
            for secret, value in SAMPLE_SECRETS.items():
                assert value not in rendered, f"{name}: {secret} is on the command line"
            for variable in re.findall(r"\$\{?([A-Za-z_]\w*)", rendered):
                assert not SECRET_NAME.search(variable) and variable not in secret_env, (
                    f"{name}: the shell puts ${variable} (a secret) on the command line")
            assert not CREDENTIALS_IN_URL.search(rendered), f"{name}: a URL with credentials on the command line"


def test_command_line_check_catches_compose_and_shell_references():
    """The check above, on the forms of the old compose file."""
    leaks = [("postgresql+psycopg2://nas:${NAS_DB_PASSWORD:?x}@postgres:5432/optuna", {}),
             ('mlflow server --backend-store-uri "postgresql+psycopg://nas:$${NAS_DB_PASSWORD}@postgres/mlflow"', {}),
             ('exec optuna-dashboard "$$OPTUNA_STORAGE"',
              {"OPTUNA_STORAGE": "postgresql://nas:${NAS_DB_PASSWORD:?x}@p/o"})]
    for command, environment in leaks:
        with pytest.raises(AssertionError):
            test_no_command_line_carries_a_secret({"leaky": {"command": command, "environment": environment}})
    test_no_command_line_carries_a_secret({"ok": {"command": "--from-config /etc/c.toml", "environment": {}}})


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_inline_shell_scripts_parse(compose):
    scripts = _shell_scripts(compose)
    assert {name for name, _ in scripts} >= {"mlflow", "s3-create-bucket"}
    for name, script in scripts:
        result = subprocess.run(["bash", "-n"], input=_render(script), text=True, capture_output=True)
        assert result.returncode == 0, f"{name}: {result.stderr}"


def test_header_gives_the_commands_and_the_optuna_storage_url():
    header = COMPOSE_FILE.read_text().split("\nname:", 1)[0]
    assert "docker compose up -d" in header
    assert "export MLFLOW_TRACKING_URI=http://localhost:5000" in header
    sweep = re.search(r"nas sweep (\S+) --address ray://localhost:10001", header)
    assert sweep and (REPO / sweep.group(1)).is_file()
    assert re.search(r"postgresql\+psycopg://nas:\S+@localhost:5432/optuna", header)


def test_dockerfile_installs_pinned_torch_then_the_pinned_package_on_python_3_11(dockerfile):
    assert re.search(r"^FROM python:3\.11[-.]", dockerfile, re.MULTILINE)
    torch = Version(version("torch")).public
    assert re.search(rf"^ARG TORCH_VERSION={re.escape(torch)}$", dockerfile, re.MULTILINE)
    assert re.search(r'pip install --index-url "\$\{TORCH_INDEX_URL\}" "torch==\$\{TORCH_VERSION\}"', dockerfile)
    assert re.search(r"^ARG TORCH_INDEX_URL=\S+", dockerfile, re.MULTILINE)
    assert "pip install -r /tmp/requirements.txt" in dockerfile
    assert re.search(r"pip install --no-deps \S+ && pip check", dockerfile)


def test_image_pins_every_dependency_of_pyproject_at_the_tested_version():
    pins = {}
    for line in REQUIREMENTS.read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            req = Requirement(line)
            (spec,) = req.specifier
            assert spec.operator == "==", f"pin {line!r} exactly"
            pins[req.name.lower()] = (spec.version, req.extras)
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    for dependency in project["dependencies"]:
        req = Requirement(dependency)
        assert req.name.lower() in pins, f"docker/requirements.txt does not pin {req.name}"
        pinned, extras = pins[req.name.lower()]
        assert req.extras <= extras, f"{req.name}: the image lacks extras {req.extras - extras}"
        assert Version(version(req.name)).public == pinned, f"{req.name}=={pinned} but the tests run {version(req.name)}"
    assert "default" in pins["ray"][1], "the Ray dashboard and client server need ray[default]"


def test_dockerfile_copies_only_what_its_dockerignore_lets_through(dockerfile):
    allowed = {line[1:] for line in (DOCKERFILE.parent / "Dockerfile.dockerignore").read_text().splitlines()
               if line.startswith("!")}
    for line in dockerfile.splitlines():
        if line.startswith("COPY") and "--from" not in line:
            sources = [arg for arg in line.split()[1:-1] if not arg.startswith("--")]
            for source in sources:
                assert source in allowed, f"COPY {source} is excluded by Dockerfile.dockerignore"
                assert (REPO / source).exists(), f"COPY {source}: no such path"


def _env_file(path: Path) -> dict[str, str]:
    """``KEY=value`` lines of an env file as compose reads them (`` #`` starts a comment in a bare value)."""
    env = {}
    for line in path.read_text().splitlines():
        if "=" in line and not line.lstrip().startswith("#"):
            key, _, value = line.partition("=")
            env[key.strip()] = re.split(r"\s#", value, maxsplit=1)[0].strip()
    return env


def test_env_example_names_every_setting_of_the_compose_file_and_env_is_ignored():
    """Credentials come from .env: .env.example lists every ${VAR} of docker-compose.yml, .env is never committed."""
    used = _compose_variables()
    listed = set(_env_file(REPO / ".env.example"))
    assert used - listed == set(), f"add these to .env.example: {sorted(used - listed)}"
    assert listed - used == set(), f".env.example lists variables compose does not use: {sorted(listed - used)}"
    assert ".env" in (REPO / ".gitignore").read_text().split()


def test_env_example_holds_no_secret_so_a_copy_must_be_filled_in():
    """A secret in .env.example would end up in production unchanged: each is empty there, and compose with
    an unedited copy as .env stops at the first one."""
    example = _env_file(REPO / ".env.example")
    for key, value in example.items():
        if SECRET_NAME.search(key):
            assert value == "", f"{key}={value!r} in .env.example: leave secrets empty"
    with pytest.raises(MissingSetting):
        _render_tree(yaml.safe_load(COMPOSE_FILE.read_text()), example)


def test_every_secret_is_required_and_compose_names_the_missing_one_and_where_to_set_it():
    """``${SECRET:?message}``, never ``${SECRET:-literal}``/``${SECRET-literal}``/``${SECRET}``: without it compose
    must refuse to start rather than run with a published default or an empty password."""
    compose = yaml.safe_load(COMPOSE_FILE.read_text())
    refs = [ref for value in _values(compose) for ref in _refs(_parse(value))]
    secrets = {ref.name for ref in refs if SECRET_NAME.search(ref.name)}
    assert {"NAS_DB_PASSWORD", "NAS_S3_SECRET_KEY", "RAY_AUTH_TOKEN", "MLFLOW_AUTH_ADMIN_PASSWORD",
            "MLFLOW_FLASK_SERVER_SECRET_KEY"} <= secrets

    def required(ref: Ref) -> bool:  # a value, or a default that is itself only a required secret
        if ref.op == ":?":
            return True
        return ref.op == ":-" and len(ref.arg) == 1 and isinstance(ref.arg[0], Ref) and required(ref.arg[0])

    for ref in refs:
        if SECRET_NAME.search(ref.name):
            assert required(ref), f"${{{ref.name}{ref.op}...}}: a secret must be ${{{ref.name}:?...}} (no default)"
            if ref.op == ":?":
                message = _render_tokens(ref.arg, {})
                assert ref.name in message and ".env" in message, f"{ref.name}: the error must say what to set where"
        literal = "".join(token for token in ref.arg if isinstance(token, str))
        assert not CREDENTIALS_IN_URL.search(literal), f"${{{ref.name}...}}: a default with a password in a URL"
    for name in sorted({ref.name for ref in refs if ref.op == ":?"}):  # (the others default to one of these)
        env = {key: value for key, value in SAMPLE_SECRETS.items() if key != name}
        for missing in (env, {**env, name: ""}):  # unset, or set empty in .env
            with pytest.raises(MissingSetting) as err:
                _render_tree(compose, missing)
            assert err.value.name == name
    assert _render_tree(compose, SAMPLE_SECRETS)  # all set: compose starts


def test_secret_check_rejects_defaults_and_accepts_required_values():
    """The check above, on the forms it must tell apart."""
    assert [r.op for r in _refs(_parse("${NAS_DB_PASSWORD:-nas}${RAY_AUTH_TOKEN-t}${A:?set A in .env}"))] == [
        ":-", "-", ":?"]
    nested = _parse("${MLFLOW_TRACKING_PASSWORD:-${MLFLOW_AUTH_ADMIN_PASSWORD:?set it in .env}}")
    assert _render_tokens(nested, {"MLFLOW_AUTH_ADMIN_PASSWORD": "p"}) == "p"
    assert _render_tokens(nested, {"MLFLOW_TRACKING_PASSWORD": "q"}) == "q"
    with pytest.raises(MissingSetting, match="MLFLOW_AUTH_ADMIN_PASSWORD"):
        _render_tokens(nested, {"MLFLOW_TRACKING_PASSWORD": ""})
    assert _render("$${NAS_DB_PASSWORD} ${NAS_BIND_ADDRESS:-127.0.0.1}", {}) == "${NAS_DB_PASSWORD} 127.0.0.1"
    assert SECRET_NAME.search("NAS_S3_ACCESS_KEY") and SECRET_NAME.search("NAS_OPTUNA_STORAGE_URL")
    assert not SECRET_NAME.search("NAS_BIND_ADDRESS") and not SECRET_NAME.search("NAS_TORCH_INDEX_URL")
