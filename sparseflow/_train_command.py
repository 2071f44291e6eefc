"""`sparseflow train`: argument parsing and wiring of the training program."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

import jax

import embedding
import pipelines
from sparseflow import _compilation_cache, _launch, _train
from sparseflow._arguments import (
    add_compilation_cache_argument,
    add_config_argument,
    add_devices_argument,
    non_negative_int,
    positive_int,
)
from sparseflow._checkpoint import CheckpointMismatchError
from sparseflow._command_config import CommandConfig
from sparseflow._errors import UsageError
from sparseflow._train_summary import summary
from sparseflow.config._run_config import RunConfig

_LAUNCH_TIMEOUT_S = 6 * 3600.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_argument(parser)
    parser.add_argument(
        "--data", help="training ArrayRecord files, dir or glob (default: the config's dataset)"
    )
    parser.add_argument(
        "--eval-data",
        help="held-out ArrayRecord data: report its AUC at the end (default: dataset.eval)",
    )
    parser.add_argument(
        "--steps", type=positive_int, help="training steps (default: training.steps)"
    )
    parser.add_argument(
        "--pipelined",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="SC/TC pipelining (default: training.pipelined)",
    )
    parser.add_argument("--fdo", type=Path, help="FDO stats (file or dir) to set the limits from")
    parser.add_argument("--checkpoint-dir", type=Path, help="write checkpoints here")
    parser.add_argument("--resume", action="store_true", help="continue from the newest checkpoint")
    parser.add_argument("--metrics-dir", type=Path, help="TensorBoard event files")
    parser.add_argument(
        "--stop-after",
        type=positive_int,
        # A test hook: exit abruptly after N steps, as a crash would.
        help=argparse.SUPPRESS,
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument(
        "--input-timeout",
        type=positive_int,
        default=int(pipelines.DEFAULT_INPUT_TIMEOUT_S),
        metavar="SECONDS",
        help="stop with an error when no batch comes for this long "
        "(default: %(default)s; a Grain worker that dies stops the run at once)",
    )
    add_devices_argument(parser)
    add_compilation_cache_argument(parser)
    parser.add_argument(
        "--num-processes",
        type=positive_int,
        default=1,
        help="processes (hosts); >1 without --process-id starts them locally on 127.0.0.1",
    )
    parser.add_argument(
        "--process-id", type=non_negative_int, help="this process's index (several hosts)"
    )
    parser.add_argument("--coordinator", help="host:port of process 0's coordinator")
    parser.add_argument(
        "--coordinator-bind-address",
        help="host:port process 0's coordinator listens on (default: --coordinator's address; "
        "e.g. 0.0.0.0:PORT behind an address translation)",
    )
    parser.add_argument(
        "--agreement-port",
        type=non_negative_int,
        default=0,
        help="first port of the minibatching agreement (default: training.agreement_port; "
        "a local launch picks a free one)",
    )
    parser.add_argument(
        "--agreement-hosts", help="comma-separated host of every process, in process order"
    )
    parser.add_argument(
        "--agreement-tls-dir",
        type=Path,
        help="mutual TLS for the agreement: ca.crt, rank-<r>.crt, rank-<r>.key "
        "(default: training.agreement_tls_dir)",
    )
    parser.add_argument(
        "--agreement-secret-file",
        type=Path,
        help="the run's shared secret; agreement messages carry an HMAC keyed by it "
        "(default: training.agreement_secret_file)",
    )


def run(args: argparse.Namespace, command_config: CommandConfig) -> None:
    if args.num_processes < 1:
        raise UsageError(f"--num-processes must be >= 1, got {args.num_processes}.")
    # None (auto): every process shows the devices it sees, none is forced.
    requested = command_config.requested_devices
    if requested is not None and requested % args.num_processes:
        given = "--devices" if args.devices is not None else "mesh.devices:"
        raise UsageError(
            f"{given} {requested} cannot be split over {args.num_processes} processes "
            "(--num-processes): give a multiple of it."
        )
    per_process = None if requested is None else requested // args.num_processes
    if args.num_processes > 1 and args.process_id is None:
        # The launcher starts no JAX backend (`auto` is the launched processes'
        # to resolve); a config that needs no JAX to check is checked once here.
        if requested is not None:
            command_config.load()
        argv = list(args.argv)
        if not (args.agreement_port or command_config.early().training.agreement_port):
            argv += [
                "--agreement-port",
                str(_launch.free_port_block(args.num_processes, _train.AGREEMENT_PORT_STRIDE)),
            ]
        try:
            _launch.launch_local_processes(argv, args.num_processes, per_process, _LAUNCH_TIMEOUT_S)
        except _launch.ProcessFailedError as error:
            print(f"error: {error}", file=sys.stderr)
            raise SystemExit(error.exit_status) from error
        return
    # Only the CPU platform reads this; it must be set before JAX starts a backend.
    if per_process is not None:
        _launch.use_cpu_devices(per_process)
    if args.num_processes > 1:
        if args.coordinator is None:
            raise UsageError("--process-id needs --coordinator host:port.")
        _launch.initialize_distributed(
            args.coordinator,
            args.num_processes,
            args.process_id,
            bind_address=args.coordinator_bind_address,
        )
        _compilation_cache.share_between_processes()
    config = with_agreement_security(args, command_config.load())
    try:
        result = _train.train(config, options(args, config))
    except (embedding.FdoStatsError, CheckpointMismatchError) as error:
        # Stats or checkpoints of another device count (the mismatch names
        # `geometry.devices` or `mesh.devices`): say where this run's came from.
        if config.devices_origin is not None and ".devices:" in str(error):
            error.add_note(f"Devices of this run: {config.devices_origin}.")
        raise
    prefix = f"[process {jax.process_index()}] " if jax.process_count() > 1 else ""
    print(prefix + summary(config, result), flush=True)


def with_agreement_security(args: argparse.Namespace, config: RunConfig) -> RunConfig:
    """`config` with the agreement's TLS directory and secret file from the command line."""
    overrides = {
        name: getattr(args, name).absolute()
        for name in ("agreement_tls_dir", "agreement_secret_file")
        if getattr(args, name) is not None
    }
    if not overrides:
        return config
    return dataclasses.replace(config, training=dataclasses.replace(config.training, **overrides))


def options(args: argparse.Namespace, config: RunConfig) -> _train.TrainOptions:
    return _train.TrainOptions(
        data=args.data or list(config.dataset.train_data),
        eval_data=args.eval_data or config.dataset.eval,
        steps=args.steps,
        pipelined=args.pipelined,
        fdo_dir=args.fdo,
        checkpoint_dir=args.checkpoint_dir,
        resume=args.resume,
        metrics_dir=args.metrics_dir,
        stop_after=args.stop_after,
        progress=not args.no_progress,
        agreement_port=args.agreement_port,
        agreement_hosts=args.agreement_hosts.split(",") if args.agreement_hosts else None,
        input_timeout_s=args.input_timeout,
    )
