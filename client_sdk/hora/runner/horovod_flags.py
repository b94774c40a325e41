"""What ``horarun`` takes from horovodrun without having a use for it.

Two things: horovodrun's flags that ask for something hora does not have
(:data:`IGNORED`; each draws one notice saying why it does not matter),
and horovodrun's YAML ``--config-file`` (:func:`apply_config_file`), whose
keys stand for flags and pass the same checks.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Collection
from typing import Any, cast

__all__ = ["CONFIG_KEYS", "IGNORED", "apply_config_file", "ignored_flag_notices"]

# horovodrun's flags that ask for something hora does not have, and why it
# does not matter (by argparse dest). A flag set to False asks for nothing
# hora does not do anyway, so only True or a value draws the notice.
IGNORED = {
    "hierarchical_allreduce": "hora has no hierarchical allreduce; its data plane (shared "
                              "memory within a machine, Gloo or NCCL across) picks the "
                              "algorithm, and the results are the same",
    "hierarchical_allgather": "hora has no hierarchical allgather; its data plane picks the "
                              "algorithm, and the results are the same",
    "torus_allreduce": "hora has no torus allreduce; its data plane picks the algorithm, and "
                       "the results are the same",
    "num_nccl_streams": "hora does not take a number of NCCL streams; the results are the same",
    "thread_affinity": "hora does not pin its background thread to a core",
    "ccl_bgt_affinity": "hora does not use oneCCL's background thread",
    "binding_args": "process binding arguments are for mpirun, and hora does not use MPI",
    "mpi_args": "mpirun arguments are for MPI, and hora does not use MPI",
    "mpi_threads_disable": "MPI threading applies to MPI, and hora does not use MPI",
    "autotune_steps_per_sample": "hora's autotuner measures time windows, not step counts",
    "autotune_gaussian_process_noise": "hora's autotuner searches a grid instead of Bayesian "
                                       "optimization, so it has no noise parameter",
}

# horovodrun's --config-file (YAML): (section, key) -> argparse dest. A flag
# given on the command line wins over the file, wherever it stands.
CONFIG_KEYS = {
    ("params", "fusion_threshold_mb"): "fusion_threshold_mb",
    ("params", "cycle_time_ms"): "cycle_time_ms",
    ("params", "cache_capacity"): "cache_capacity",
    ("params", "hierarchical_allreduce"): "hierarchical_allreduce",
    ("params", "hierarchical_allgather"): "hierarchical_allgather",
    ("autotune", "enabled"): "autotune",
    ("autotune", "log_file"): "autotune_log_file",
    ("autotune", "warmup_samples"): "autotune_warmup_samples",
    ("autotune", "steps_per_sample"): "autotune_steps_per_sample",
    ("autotune", "bayes_opt_max_samples"): "autotune_bayes_opt_max_samples",
    ("autotune", "gaussian_process_noise"): "autotune_gaussian_process_noise",
    ("timeline", "filename"): "timeline_filename",
    ("timeline", "mark_cycles"): "timeline_mark_cycles",
    ("stall_check", "enabled"): "no_stall_check",  # inverted
    ("stall_check", "warning_time_seconds"): "stall_check_time",
    ("stall_check", "shutdown_time_seconds"): "stall_shutdown_time",
    ("library_options", "mpi_threads_disable"): "mpi_threads_disable",
    ("library_options", "num_nccl_streams"): "num_nccl_streams",
    ("library_options", "ccl_bgt_affinity"): "ccl_bgt_affinity",
    ("library_options", "gloo_timeout_seconds"): "gloo_timeout_seconds",
    ("logging", "level"): "log_level",
    ("logging", "with_timestamp"): "log_with_timestamp",
}


def ignored_flag_notices(ns: argparse.Namespace, set_by_file: Collection[str]) -> list[str]:
    """One notice per flag of :data:`IGNORED` given on the command line.

    Args:
        ns: the parsed command line.
        set_by_file: dests the config file set; its own notices say so.
    """
    return [f"ignoring {_flag(dest)}: {why}" for dest, why in IGNORED.items()
            if getattr(ns, dest, None) not in (None, False) and dest not in set_by_file]


def _flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def apply_config_file(parser: argparse.ArgumentParser, ns: argparse.Namespace,
                      path: str, applied: dict[str, str]) -> list[str]:
    """Fills ``ns`` from Horovod's YAML config file where the command line left a gap.

    Values go through the same checks as the flags they stand for.

    Args:
        parser: the parser, for its checks and its errors.
        ns: what the command line gave; filled in place.
        path: the file.
        applied: filled with ``dest -> 'section.key'`` for what the file set.

    Returns:
        Notices for keys that are ignored (unknown, or nothing hora has).

    Raises:
        SystemExit: (via ``parser.error``) the file cannot be read, is not
            YAML mappings, asks for MPI, or holds a value its flag refuses.
    """
    import yaml  # only this flag needs it

    where = f"--config-file {path}"
    try:
        with open(path, encoding="utf-8") as f:
            config = yaml.safe_load(f)
    except OSError as exc:
        parser.error(f"--config-file: cannot read {path!r}: {exc.strerror or exc}")
    except yaml.YAMLError as exc:
        parser.error(f"{where}: not valid YAML: {exc}")
    config = {} if config is None else config
    if not isinstance(config, dict):
        parser.error(f"{where}: expected sections such as 'params:', got "
                     f"{type(config).__name__}")
    # Each dest's first option: its type is the check a value must pass.
    actions: dict[str, argparse.Action] = {}
    for option in parser._actions:
        actions.setdefault(option.dest, option)
    notices: list[str] = []
    for section, body in config.items():
        if section == "controller":
            if str(body).lower() != "gloo":
                parser.error(f"{where}: controller: {body}: hora runs over Gloo only")
            continue
        if not isinstance(body, dict):
            parser.error(f"{where}: section {section!r} must hold 'key: value' lines")
        for key, value in body.items():
            dest = CONFIG_KEYS.get((section, key))
            name = f"{section}.{key}"
            if dest is None:
                notices.append(f"ignoring {name} in --config-file: not a Horovod setting "
                               f"hora knows")
                continue
            if getattr(ns, dest, None) is not None or value is None:
                continue  # the command line wins
            action = actions.get(dest)
            parsed: Any
            if action is None:  # a key of the file only (ccl_bgt_affinity)
                parsed = value
            elif action.const is not None:
                if not isinstance(value, bool):
                    parser.error(f"{where}: {name}: expected true or false, got {value!r}")
                parsed = (not value) if dest == "no_stall_check" else value
            elif action.type is not None:
                try:
                    # Every flag's type here is one of flags.py's functions.
                    parsed = cast(Callable[[str], Any], action.type)(str(value))
                except argparse.ArgumentTypeError as exc:
                    parser.error(f"{where}: {name}: {exc}")
            else:
                parsed = str(value)
            setattr(ns, dest, parsed)
            applied[dest] = name
            if dest in IGNORED and parsed is not False:
                notices.append(f"ignoring {name} in --config-file: {IGNORED[dest]}")
    return notices
