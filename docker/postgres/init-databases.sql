-- Run once by the postgres image, as the superuser POSTGRES_USER (nas), on an EMPTY data volume
-- (docker-entrypoint-initdb.d). POSTGRES_DB is left unset in docker-compose.yml so that neither
-- database below exists yet; a volume made by an older compose file keeps what it had:
--   docker compose exec postgres createdb -U nas optuna
CREATE DATABASE mlflow;   -- MLflow tracking server's backend store
CREATE DATABASE optuna;   -- Optuna RDB storage of the sweeps, read by optuna-dashboard
