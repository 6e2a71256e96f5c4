"""docker-compose.yml is checked by parsing (no Docker engine here)."""

import yaml

from tests.conftest import REPO


def test_compose_has_postgres_backed_mlflow_server():
    compose = yaml.safe_load((REPO / "docker-compose.yml").read_text())
    services = compose["services"]
    assert {"postgres", "mlflow"} <= set(services)
    command = services["mlflow"]["command"]
    assert "postgresql+psycopg://" in command and "@postgres:5432/" in command
    assert "--serve-artifacts" in command and "--allowed-hosts" in command
    assert services["mlflow"]["depends_on"]["postgres"]["condition"] == "service_healthy"
    assert "5000:5000" in services["mlflow"]["ports"]
    for name, service in services.items():
        for volume in service.get("volumes", []):
            assert volume.split(":")[0] in compose["volumes"], f"{name} mounts an undeclared volume {volume}"
