"""Reading a sweep YAML from disk: duplicate keys, ``${VAR}`` interpolation, validation, and the checks that
need more than the YAML (the point files of ``points_to_evaluate``, its points against the space, data files, the
latency predictor file).

This is the top of the spec layer: it imports the schema, the search space and the torch-free file checks,
and nothing imports it back inside ``nas.space``. No torch, Ray, Optuna or MLflow.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from nas.space.datafiles import check_data_files
from nas.space.errors import SpecError, format_validation_error, key_path
from nas.space.predictor_file import read_predictor_meta, workload_mismatch, workload_of, workload_tag
from nas.space.rebase import rebase_paths
from nas.space.schema import REDACTED, REFERENCE_POINTS, ArchPoint, SweepSpec
from nas.space.schema.points import POINT_EXAMPLE, named_arch_problem
from nas.space.space import SearchSpace

__all__ = ["apply_overrides", "load_spec", "parse_spec"]


class _UniqueKeyLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that rejects a key repeated in one mapping (PyYAML silently keeps the last one, so
    a second ``space:`` section would drop the first). Keys merged in with ``<<:`` may be overridden."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: dict[Any, yaml.Mark] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=True)
            try:
                first = seen.setdefault(key, key_node.start_mark)
            except TypeError:  # an unhashable key: the base class reports it
                continue
            if first is not key_node.start_mark:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r} (first at line {first.line + 1}); keep one of them",
                    key_node.start_mark)
        return super().construct_mapping(node, deep=deep)


def parse_spec(raw: Any, source: str = "<yaml>") -> SweepSpec:
    """Validate a parsed YAML mapping (no file checks, no interpolation).

    Raises:
        SpecError: naming each bad key path, one line per problem (:func:`format_validation_error`).
    """
    if not isinstance(raw, dict):
        raise SpecError(f"{source}: the top level must be a mapping of keys (name, data, supernet, ...)")
    try:
        return SweepSpec.model_validate(raw)
    except ValidationError as e:
        raise SpecError(format_validation_error(e, source, SweepSpec)) from None


_ENV_REF = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")
"""A ``${VAR}`` reference to an environment variable inside a YAML string."""


LOCATION_KEYS = ("name", "workdir", "data")
"""Top-level YAML keys whose ``${VAR}`` references are locations, not secrets (``workdir: ${SCRATCH}/runs``):
logged as they are, since ``nas export`` and ``nas report`` read the run and data folders back from MLflow tags.
A reference in any other key is a secret, masked wherever the spec is logged (:meth:`SweepSpec.redact`)."""


def _interpolate(raw: Any, loc: tuple[Any, ...], secrets: dict[tuple[str, ...], tuple[str, frozenset[str]]],
                 source: str) -> Any:
    """``raw`` with ``${VAR}`` in its string values replaced by the environment's values; ``secrets`` gets, for
    each key path (outside :data:`LOCATION_KEYS`) whose value referenced a non-empty variable, ``(masked,
    values)``: the YAML's string with each reference shown as ``***``, and the substituted string with the
    variables' values.

    Raises:
        SpecError: a referenced variable is not set (names the key path and the variable).
    """
    if isinstance(raw, dict):
        return {k: _interpolate(v, (*loc, k), secrets, source) for k, v in raw.items()}
    if isinstance(raw, list):
        return [_interpolate(v, (*loc, i), secrets, source) for i, v in enumerate(raw)]
    if not isinstance(raw, str):
        return raw

    values: set[str] = set()

    def value(m: re.Match) -> str:
        name = m.group(1)
        if name not in os.environ:
            raise SpecError(f"{source}: {key_path(loc)}: environment variable {name} is not set; export it "
                            f"(e.g. in .env) or write the value in the YAML")
        if os.environ[name]:  # an empty value hides nothing
            values.add(os.environ[name])
        return os.environ[name]

    out = _ENV_REF.sub(value, raw)
    if values and (not loc or loc[0] not in LOCATION_KEYS):
        masked = _ENV_REF.sub(lambda m: REDACTED if os.environ[m.group(1)] else "", raw)
        secrets[tuple(str(k) for k in loc)] = (masked, frozenset({out, *values}))
    return out


def _parse_override(item: str) -> tuple[tuple[str, ...], Any]:
    """``"train.steps=2"`` -> (``("train", "steps")``, ``2``): the value is read as YAML (numbers, lists, ...)."""
    key, sep, value = item.partition("=")
    keys = tuple(key.strip().split("."))
    if not sep or not all(keys):
        raise SpecError(f"--set {item}: expected KEY.PATH=VALUE, e.g. --set train.steps=2")
    try:
        return keys, yaml.safe_load(value) if value.strip() else ""
    except yaml.YAMLError as e:
        raise SpecError(f"--set {item}: the value is not valid YAML ({getattr(e, 'problem', e)})") from None


def apply_overrides(raw: Any, overrides: tuple[str, ...] | list[str], source: str) -> Any:
    """``raw`` (a parsed YAML mapping, not changed) with each ``KEY.PATH=VALUE`` of ``overrides`` set, in order;
    missing sections are created (validation then names any unknown key), as Hydra's ``+key=value`` and Ray's
    ``--config`` overrides let users cut a YAML down without editing it.

    Raises:
        SpecError: a malformed override, a value that is not YAML, or a key path through a non-mapping value.
    """
    import copy

    out = copy.deepcopy(raw)
    for item in overrides:
        keys, value = _parse_override(item)
        node = out
        for key in keys[:-1]:
            if not isinstance(node, dict):
                break
            node = node.setdefault(key, {})
        if not isinstance(node, dict):
            raise SpecError(f"{source}: --set {item}: {'.'.join(keys[:-1])} is not a section (a mapping) in the "
                            f"YAML, so it has no key {keys[-1]!r}")
        node[keys[-1]] = value
    return out


def load_spec(path: str | Path, *, check_files: bool = True, check_predictor: bool | None = None,
              overrides: tuple[str, ...] | list[str] = (), base_dir: str | Path | None = None) -> SweepSpec:
    """Read and validate a sweep YAML; nothing is started or written, and torch is not imported.

    String values may reference environment variables as ``${VAR}``; the substituted values are kept on the
    spec so that :meth:`SweepSpec.redact` hides them wherever the spec is logged.

    Raises:
        SpecError: unreadable file, malformed YAML (with the line number), a ``${VAR}`` whose variable is not
            set, an unknown key
            (with a suggestion), a duplicated key, a wrong type, an impossible space, a point file of
            ``search.points_to_evaluate`` that is missing or malformed, an arch of it outside the space, or
            (``check_files``) a data file that is missing, a folder, unreadable, not gzip/UTF-8 text
            or empty, or source and target files of a split with different line counts; or
            (``check_predictor``, default ``check_files``) a ``search.latency_predictor`` that is missing or
            fitted for another model_dim or latency workload; each names the key path; or a malformed
            ``overrides`` item.

    ``overrides``: ``KEY.PATH=VALUE`` items (``nas sweep FILE --set train.steps=2``) applied to the YAML before
    validation (:func:`apply_overrides`); the spec then keeps the effective YAML (:meth:`SweepSpec.yaml_text`),
    which the sweep saves as its copy, so ``--resume`` continues with the same values.

    ``search.points_to_evaluate`` entries ``{file: FILE}`` are replaced by the file's named archs (a relative FILE is
    read from the sweep YAML's folder, :func:`_read_point_files`); the effective YAML then holds the archs, so a
    resumed sweep scores the archs it started with.

    ``base_dir``: the folder that relative paths (data files, ``workdir``, ``data.cache_dir``, ...) are relative to,
    default the current one (:func:`nas.space.rebase.rebase_paths`).
    """
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise SpecError(f"cannot read sweep file {path}: {e.strerror}") from None
    except UnicodeDecodeError as e:
        raise SpecError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start}); save the file as UTF-8") from None
    try:
        raw = yaml.load(text, Loader=_UniqueKeyLoader)  # the safe loader, plus duplicate-key errors
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise SpecError(f"{path}:{where}: malformed YAML: {getattr(e, 'problem', e)}") from None
    source_text = None
    if overrides:
        if not isinstance(raw, dict):
            raise SpecError(f"{path}: the top level must be a mapping of keys (name, data, supernet, ...)")
        raw = apply_overrides(raw, overrides, str(path))
    raw, origins = _read_point_files(raw, path, str(path))
    if overrides or origins:
        changes = ([f"--set {' --set '.join(overrides)}"] if overrides else []) + \
            ([f"search.points_to_evaluate's files ({', '.join(sorted({str(f) for _, f, _ in origins.values()}))}) "
              f"inlined"] if origins else [])
        source_text = (f"# {path} with {' and '.join(changes)}\n"
                       + yaml.safe_dump(raw, sort_keys=False, allow_unicode=True))
    secrets: dict[tuple[str, ...], tuple[str, frozenset[str]]] = {}
    raw = _interpolate(raw, (), secrets, str(path))
    if base_dir is not None:
        raw = rebase_paths(raw, Path(base_dir), SweepSpec)
    source = f"{path} (with --set {', '.join(overrides)})" if overrides else str(path)
    spec = parse_spec(raw, source).keep_secrets(secrets).keep_source(source_text)
    _check_points(spec, str(path), origins)
    if check_files:
        check_data_files(spec, str(path))
    if check_files if check_predictor is None else check_predictor:
        _check_latency_predictor(spec, str(path))
    return spec


POINT_FILE_KEY = "file"
"""The key of a ``search.points_to_evaluate`` entry that names a point file (``{file: baselines.yaml}``)."""


def _read_point_files(raw: Any, path: Path, source: str) -> tuple[Any, dict[int, tuple[int, Path, str]]]:
    """``raw`` with each ``{file: FILE}`` entry of ``search.points_to_evaluate`` replaced by the file's named archs,
    ``{name: NAME, arch: ARCH}`` in the file's order (a YAML mapping of names to arch strings; a relative FILE is
    read from the folder of the sweep YAML ``path``; ``${VAR}`` in it is substituted), and where each such entry
    came from: its index in the new list -> (the index of the ``file`` entry in the YAML, the file, the name).
    ``raw`` itself is not changed.

    Raises:
        SpecError: an entry with other keys than ``file``; a point file that is missing, unreadable, not YAML,
            not a non-empty mapping, or with a malformed name or arch (names the key path, the file and the fix).
    """
    points = raw.get("search", {}).get("points_to_evaluate") if isinstance(raw, dict) and \
        isinstance(raw.get("search"), dict) else None
    if not isinstance(points, list) or not any(isinstance(p, dict) and POINT_FILE_KEY in p for p in points):
        return raw, {}
    out: list[Any] = []
    origins: dict[int, tuple[int, Path, str]] = {}
    for i, point in enumerate(points):
        if not (isinstance(point, dict) and POINT_FILE_KEY in point):
            out.append(point)
            continue
        where = f"{source}: search.points_to_evaluate.{i}"
        if set(point) != {POINT_FILE_KEY} or not isinstance(point[POINT_FILE_KEY], str):
            raise SpecError(f"{where}: a point file entry is {{file: FILE.yaml}} alone (a path, relative to "
                            f"{path.parent}), got {point!r}")
        name = _interpolate(point[POINT_FILE_KEY], ("search", "points_to_evaluate", i, POINT_FILE_KEY), {}, source)
        file = Path(name).expanduser()
        file = file if file.is_absolute() else path.parent / file
        try:
            named = _point_file_archs(file)
        except ValueError as e:
            raise SpecError(f"{where}: {e}") from None
        for entry in named:
            origins[len(out)] = (i, file, entry["name"])
            out.append(entry)
    search = {**raw["search"], "points_to_evaluate": out}
    return {**raw, "search": search}, origins


def _point_file_archs(path: Path) -> list[dict[str, str]]:
    """The named archs of a point file, in its order, as ``{name, arch}`` entries: a YAML mapping of names to arch
    strings (``tiny: "enc[128/256 128/256] dec[128/256 128/256]"``).

    Raises:
        ValueError: the file is missing or unreadable, not YAML, not a non-empty mapping, or a name or an arch is
            malformed (names the file, the entry and the fix).
    """
    fix = f"write it as NAME: ARCH lines, e.g. tiny: {POINT_EXAMPLE}"
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ValueError(f"point file not found: {path} (a relative path is read from the sweep YAML's folder); "
                         f"fix the path, or create the file and {fix}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"cannot read point file {path}: {getattr(e, 'strerror', None) or e}") from None
    try:
        raw = yaml.load(text, Loader=_UniqueKeyLoader)  # a name given twice is an error, not the last one kept
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" line {mark.line + 1}, column {mark.column + 1}:" if mark else ""
        raise ValueError(f"point file {path}:{where} malformed YAML: {getattr(e, 'problem', e)}") from None
    if not isinstance(raw, dict) or not raw:
        raise ValueError(f"point file {path} holds no named archs; {fix}")
    points = []
    for name, arch in raw.items():
        why = named_arch_problem(name, arch)
        if why is not None:
            raise ValueError(f"point file {path}: {name}: {why}")
        points.append({"name": name, "arch": arch})
    return points


def _check_points(spec: SweepSpec, source: str, origins: dict[int, tuple[int, Path, str]] | None = None) -> None:
    """Every ``search.points_to_evaluate`` entry lies in this space: a mapping names parameters of the space with
    allowed values, an arch (a string or a named one, maybe from a point file: ``origins``, index -> (the YAML's
    index, file, name), :func:`_read_point_files`) is an arch of the space (:meth:`SearchSpace.arch_point_params`).

    Raises:
        SpecError: naming the point's index (and file and name), the choice outside the space and the fix.
    """
    space = SearchSpace.from_spec(spec)
    origins = origins or {}
    for i, point in enumerate(spec.search.points_to_evaluate):
        if isinstance(point, dict):
            why = space.check_params(point)
            if why is not None:
                raise SpecError(f"{source}: search.points_to_evaluate.{i}: {why}")
            continue
        if isinstance(point, str) and point in REFERENCE_POINTS:
            continue
        try:
            space.point_params([point])
        except ValueError as e:
            name, index = (point.name if isinstance(point, ArchPoint) else None), i
            if i in origins:
                index, file, name = origins[i]
                where, fix = f"{name} of point file {file}", f"fix or remove {name} in {file}"
            else:
                where, fix = (f"arch {name!r}" if name else "the arch"), "fix or remove the point"
            arch = point.arch if isinstance(point, ArchPoint) else point
            raise SpecError(f"{source}: search.points_to_evaluate.{index}: {where} ({arch}) is outside the space: {e}; "
                            f"{fix}, or widen space.* to hold it (nas space show {source} lists the choices)") \
                from None


def _check_latency_predictor(spec: SweepSpec, source: str) -> None:
    """``search.latency_predictor`` exists and was fitted for this supernet's model_dim and the YAML's latency
    workload (``search.latency_workload``; read without torch: :func:`read_predictor_meta`).

    Raises:
        SpecError: naming the key, the file and the fix.
    """
    path = spec.search.latency_predictor
    if path is None:
        return
    fix = f"write one with `nas latency fit {source} --out {path}`"
    if not path.is_file():
        raise SpecError(f"{source}: search.latency_predictor: file not found: {path}; "
                        f"{fix}")
    try:
        meta = read_predictor_meta(path)
    except Exception as e:  # a file that is not a predictor: any reader error says so
        raise SpecError(f"{source}: search.latency_predictor: {path} is not a latency predictor ({e}); {fix}") from None
    model_dim, workload = meta["model_dim"], workload_of(spec.search)
    if model_dim != spec.supernet.model_dim:
        raise SpecError(f"{source}: search.latency_predictor: {path} was fitted for model_dim {model_dim}, "
                        f"but supernet.model_dim is {spec.supernet.model_dim}; {fix}")
    diff = workload_mismatch(meta["workload"], workload)
    if diff:
        raise SpecError(f"{source}: search.latency_predictor: {path} predicts latency workload "
                        f"{workload_tag(meta['workload'])}, but trials time search.latency_workload "
                        f"{workload_tag(workload)} ({diff}); {fix}")
