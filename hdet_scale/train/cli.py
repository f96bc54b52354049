"""``hdet-train [CONFIG.yaml] [key=value ...]``: the reference HDET trainer.

Under ``torchrun`` or the ``deepspeed`` launcher (``RANK``/``WORLD_SIZE`` set) it trains
the rank it is. Started bare, it validates the config, then starts ``nproc`` local ranks
itself (CPU, gloo) and waits for them; if one fails, the others are stopped.

Exit codes (docs/config.md, "Exit codes and signals"):
  0    done
  1    a rank failed (a crash: its traceback is above)
  2    bad input: config, data, run_dir or checkpoint (one message on stderr, naming the
       key or file; found before any rank starts where it can be)
  3    a stale DeepSpeed op build lock blocks the start (the message names the file)
  130  stopped by SIGINT (Ctrl-C); 143: by SIGTERM; 129: by SIGHUP. Every rank ends; the line printed
       names the last checkpoint (continue with train.resume=true). A signal after the run wrote
       summary.json: 0 (the run is complete)
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from typing import Any

from hdet_scale.errors import HDETConfigError, HDETStateError
from hdet_scale.train.launcher import USER_ERROR as _USER_ERROR  # the exit code of a user error
from hdet_scale.train.launcher import StoppedBeforeStart, raise_stop
from hdet_scale.train.start_notes import print_engine_notes, print_resume_notice, yaml_top


def _split_args(argv: list[str]) -> tuple[str | None, list[str]]:
    """``(CONFIG.yaml or None, key=value overrides)``: a first argument without ``=``
    is the config file, and so is an existing ``.yaml`` / ``.yml`` file whose name holds
    one (so that ``hdet-train a=b.yaml`` does not say "a: unknown key")."""
    if argv and ("=" not in argv[0] or argv[0].endswith((".yaml", ".yml")) and os.path.isfile(argv[0])):
        return argv[0], argv[1:]
    return None, argv


# What torchrun and the deepspeed launcher set for every rank they start. hdet-train takes
# RANK / WORLD_SIZE as "a launcher started me" and then needs the rest: with a stray RANK in a
# shell and no MASTER_ADDR, DeepSpeed goes looking for MPI (mpi4py traceback in every rank).
_LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
_RANK_VARS = (*_LAUNCHER_VARS, "LOCAL_RANK", "LOCAL_WORLD_SIZE")

# Keys whose null means "the built-in default": an empty value (``data.path=`` from an unset
# $DATA) reads as null in OmegaConf and would train on the default without a word.
_EMPTY_IS_NOT_NULL = {
    "data.path": "leave data.path out (or data.path=null) to train on the built-in corpus (the Python standard "
                 "library's sources)",
    "deepspeed_config": "leave deepspeed_config out (or deepspeed_config=null) for the packaged DeepSpeed JSON",
    "run_dir": "leave run_dir out for the default (runs/default)",
    # an empty one would send the run to the W&B project "hdet" (the logger's fallback for none)
    "wandb.project": "leave wandb.project out for the default (hdet-scale)",
}
_GIVE = {"wandb.project": "a W&B project name"}  # what the others take: a path

#: What one local rank holds before its model (interpreter, torch, DeepSpeed, the corpus):
#: 140-270 MiB measured per rank on this CPU machine. The launcher refuses an ``nproc``
#: whose ranks could not even start in the memory available (nproc=100000 once took a
#: shared machine down with the out-of-memory killer).
RANK_FLOOR_MIB = 200


def _mem_available_mib() -> float | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) / 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _check_local_ranks(nproc: int) -> None:
    """Refuse ``nproc`` local ranks that cannot fit in this machine's available memory at
    :data:`RANK_FLOOR_MIB` each, before any is started.

    Raises:
        HDETConfigError: naming ``nproc``, the memory needed and available.
    """
    available = _mem_available_mib()
    if available is not None and nproc * RANK_FLOOR_MIB > available:
        raise HDETConfigError(
            f"nproc={nproc}: {nproc} local ranks need at least {nproc * RANK_FLOOR_MIB / 1024:.1f} GiB before the "
            f"model (about {RANK_FLOOR_MIB} MiB each), and this machine has {available / 1024:.1f} GiB available: "
            f"at most {int(available // RANK_FLOOR_MIB)} ranks fit; nproc is the ranks on this machine (one per GPU)")


def _check_empty_overrides(overrides: list[str]) -> None:
    """Refuse ``key=`` (empty or blank value) for the keys of :data:`_EMPTY_IS_NOT_NULL`.

    Raises:
        HDETConfigError: naming the key, the override as given and how to get the default.
    """
    for item in overrides:
        key, sep, value = item.partition("=")
        if sep and key.strip() in _EMPTY_IS_NOT_NULL and not value.strip():
            raise HDETConfigError(f"{key.strip()}: empty value ({item!r}; an unset shell variable?): give "
                                  f"{_GIVE.get(key.strip(), 'a path')}, or {_EMPTY_IS_NOT_NULL[key.strip()]}")


def _started_by_launcher() -> bool:
    """Whether a launcher (``torchrun``, ``deepspeed``) started this process: ``RANK`` or
    ``WORLD_SIZE`` is set. Then the whole set must be there and agree.

    Raises:
        HDETConfigError: ``RANK`` / ``WORLD_SIZE`` set without ``MASTER_ADDR`` /
            ``MASTER_PORT`` (or one without the other), or values that are not integers or
            contradict each other (``RANK >= WORLD_SIZE``...); the message names every
            variable that is set and both ways out (unset them, or start under torchrun).
    """
    env = os.environ
    if "RANK" not in env and "WORLD_SIZE" not in env:
        return False
    present = [k for k in _RANK_VARS if k in env]
    given = " ".join(f"{k}={env[k]}" for k in present)
    fix = ("hdet-train reads RANK/WORLD_SIZE as a rank started by torchrun or the deepspeed launcher, which set all "
           f"of {', '.join(_LAUNCHER_VARS)} consistently. To let hdet-train start its nproc ranks itself, unset them "
           f"(env -u {' -u '.join(present)} hdet-train ...); to run under a launcher, start "
           "torchrun --nproc-per-node N -m hdet_scale.train.cli ...")
    missing = [k for k in _LAUNCHER_VARS if not env.get(k, "").strip()]
    if missing:
        raise HDETConfigError(f"environment: {given} set, but {', '.join(missing)} not: {fix}")
    ints, problems = {}, []
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_PORT"):
        if k in env:
            try:
                ints[k] = int(env[k])
            except ValueError:
                problems.append(f"{k} is not an integer")
    world, local_world = ints.get("WORLD_SIZE"), ints.get("LOCAL_WORLD_SIZE")
    if world is not None and world < 1:
        problems.append("WORLD_SIZE < 1")
    if "RANK" in ints and world is not None and not 0 <= ints["RANK"] < world:
        problems.append("RANK not in [0, WORLD_SIZE)")
    if local_world is not None and world is not None and not 1 <= local_world <= world:
        problems.append("LOCAL_WORLD_SIZE not in [1, WORLD_SIZE]")
    if "LOCAL_RANK" in ints and not 0 <= ints["LOCAL_RANK"] < (local_world or world or 1):
        problems.append("LOCAL_RANK not in [0, LOCAL_WORLD_SIZE)" if local_world else "LOCAL_RANK not in [0, WORLD_SIZE)")
    if "MASTER_PORT" in ints and not 1 <= ints["MASTER_PORT"] <= 65535:
        problems.append("MASTER_PORT not in [1, 65535]")
    if problems:
        raise HDETConfigError(f"environment: {given}: {'; '.join(problems)}: {fix}")
    return True


def _validate_once(validate: Any, run: dict, world_size: int, announce: bool) -> Any:
    """``loop.validate``, its config warnings (one replica asked to spread, auto-LR
    without a signal...) printed once as ``hdet-train: warning:`` lines by the process
    that announces (the launcher, or rank 0 under torchrun), not by Python's warning
    format from every check that meets them in every rank (9 copies in a 2-rank run).
    The ranks then ignore them (``loop.train``)."""
    import warnings

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        checked = validate(run, world_size)
    shown: set[str] = set()
    for w in seen:
        text = str(w.message)
        if not issubclass(w.category, UserWarning) or not text.startswith(SHOWN_ONCE):
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)  # not ours: as it was
        elif announce and text not in shown:
            shown.add(text)
            print(f"hdet-train: warning: {text}", file=sys.stderr, flush=True)
    return checked


#: The prefixes of the config warnings ``validate`` meets (HDETConfig, autolr).
SHOWN_ONCE = ("hdet.", "hdet_scale: ")


def _sets_nproc(path: str | None, overrides: list[str]) -> bool:
    """Whether the user set ``nproc`` (an override, or a top-level key of the YAML)."""
    if any(o.split("=", 1)[0].strip() == "nproc" for o in overrides):
        return True
    data = yaml_top(path)
    return isinstance(data, dict) and "nproc" in data


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in ("-h", "--help"):
        if len(argv) > 1:  # the rest is not ignored without a word
            print(f"hdet-train: error: {argv[0]} takes nothing after it ({' '.join(map(repr, argv[1:]))} given); "
                  f"run hdet-train {argv[0]} alone, or drop it to train", file=sys.stderr)
            return 2
        print(__doc__)
        return 0
    if argv == ["--version"]:
        from hdet_scale import __version__

        print(f"hdet-train (hdet_scale) {__version__}")
        return 0
    path, overrides = _split_args(argv)
    # Under a launcher, the errors found before train() (command line, config, environment)
    # are the same on every rank: rank 0 alone prints them, the others exit 2 silently.
    # Errors inside train() may be one rank's own (a file it fails to load): each prints.
    quiet = launched = checking = False
    try:
        from hdet_scale.train.config import load_run_config

        launched = _started_by_launcher()
        if not launched:  # SIGINT is KeyboardInterrupt already
            for sig in (signal.SIGTERM, signal.SIGHUP):
                if signal.getsignal(sig) is signal.SIG_DFL:
                    # a SIGTERM in the first second or so (the config read and checked)
                    # would otherwise end hdet-train with 143 and no line
                    signal.signal(sig, raise_stop)
        if launched:
            from hdet_scale.train.launcher import under_launcher, unlaunched_world_note

            # Only a launcher's ranks != 0 leave the words to rank 0: a RANK left in the shell
            # is this process alone in the terminal, whatever its value (else RANK=1 waits
            # 30 min without the note, and a bad key exits 2 without a line)
            quiet = int(os.environ["RANK"]) != 0 and under_launcher()  # an integer: _started_by_launcher checked it
            if not quiet and (note := unlaunched_world_note()) is not None:
                print(f"hdet-train: note: {note}", file=sys.stderr, flush=True)
        if launched:
            from hdet_scale.train import refusals

            # a torchrun restart of a job its first attempt refused: the same input, the
            # same answer, without importing torch again (53 s)
            before = refusals.remembered(argv)
            if before is not None:
                if not quiet:
                    refusals.forget_on_last_attempt(argv)
                    print(f"hdet-train: error: {before}\nhdet-train: (torchrun restart "
                          f"{os.environ[refusals.RESTART_VAR]}: the first attempt refused this input; not checked again)",
                          file=sys.stderr, flush=True)
                else:
                    refusals.wait_for_rank0()
                return _USER_ERROR
            checking = True
            from hdet_scale.train.launcher import shared_store_restarts

            if (why := shared_store_restarts()) is not None:
                raise HDETConfigError(why)
        _check_empty_overrides(overrides)
        run = load_run_config(path, overrides)
        if launched:
            from hdet_scale.train.loop import train, validate
            from hdet_scale.train.startup import check_extensions_dir
            from hdet_scale.train.stopping import exit_completed, install_rank_handlers, settle

            rank = int(os.environ["RANK"])
            local = os.environ.get("LOCAL_WORLD_SIZE", os.environ["WORLD_SIZE"])
            if rank == 0 and _sets_nproc(path, overrides) and str(run["nproc"]) != local.strip():
                # e.g. nproc=4 under a 2-rank torchrun: ignored, so said
                print(f"hdet-train: note: nproc={run['nproc']} is ignored under a launcher: it started {local} "
                      "ranks on this machine (torchrun --nproc-per-node sets them)", file=sys.stderr, flush=True)
            # the run's own checks read the same files on every rank: one message, rank 0's
            checked = _validate_once(validate, run, int(os.environ["WORLD_SIZE"]), announce=rank == 0)
            checking = False  # what follows may depend on the moment (a run_dir in use): not remembered
            if rank == 0:
                from hdet_scale.train.rundir import hold_run_dir

                hold_run_dir(run["run_dir"])  # one job per run_dir; released when rank 0 ends
            if run["backend"] == "deepspeed":
                # this machine's setting: its local rank 0 names it (one line per machine)
                quiet = os.environ.get("LOCAL_RANK", str(rank)).strip() != "0"
                check_extensions_dir()
            install_rank_handlers(run, announce=rank == 0)
            if rank == 0:
                print_engine_notes(run, path, overrides)
                print_resume_notice(run, checked, quiet_errors=True)
            quiet = False
            from torch.distributed import DistNetworkError

            started = time.time()  # summary.json written since: this attempt's
            try:
                summary = train(run, checked)
            except (HDETConfigError, HDETStateError):
                settle(_USER_ERROR)  # refused: a signal from the launcher ending the job is no stop to report
                raise
            except DistNetworkError as e:  # the rendezvous address: the environment's, not a crash
                settle(_USER_ERROR)
                where = f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}"
                reason = str(e).strip().splitlines()[0][:300]
                raise HDETConfigError(f"environment: the process group could not start at MASTER_ADDR:MASTER_PORT = "
                                      f"{where} ({reason}); choose a free MASTER_PORT, or let torchrun choose "
                                      "(--standalone)") from None
            except RuntimeError as e:
                from hdet_scale.train.rank_failures import PEER_LOST, gloo_reason, peer_lost

                if not peer_lost(e):
                    raise
                # under torchrun, not gloo's "Connection reset by peer" traceback on each
                # rank that outlived a dead one; torchrun's own lines name the failure
                from hdet_scale.train.stopping import after_failure, completed_message, run_completed

                if run_completed(run, started):  # a rank ended in the last barrier: nothing lost
                    settle(0)
                    if rank == 0:
                        print(completed_message(f"rank 0 lost the connection to a rank that ended "
                                                f"({gloo_reason(e)})", run, started), file=sys.stderr, flush=True)
                        refusals.note_completed(run["run_dir"], said=True)
                    exit_completed()

                # with no restarts left, nothing else names the checkpoint
                advice = f" {after_failure(run)}" if rank == 0 else ""  # or the restart to come
                print(f"hdet-train: rank {rank}: lost the connection to a rank that ended "
                      f"({gloo_reason(e)}).{advice}", file=sys.stderr, flush=True)
                return PEER_LOST
            settle(0)  # done: a signal now (the launcher ending the job) changes nothing
            if rank == 0:
                # a rank that fails from now on fails a completed run: torchrun's agent
                # restarts nothing and exits 0 (launchers/torchrun_quiet.py)
                refusals.note_completed(run["run_dir"], said=False)
                print(json.dumps(summary, indent=2), flush=True)
            exit_completed()  # as the hdet-train launcher's ranks: no interpreter teardown
        _check_local_ranks(run["nproc"])  # first: a world that cannot start names nproc, not a symptom
        from hdet_scale.train.run_lock import check_not_in_use

        # a running job's run_dir: said first, not advice on its files; and before torch and
        # DeepSpeed are imported (20-30 s on a loaded machine), so the refusal takes a second
        check_not_in_use(run["run_dir"])
        from hdet_scale.train.loop import validate
        from hdet_scale.train.startup import (
            STALE_LOCK_EXIT,
            check_extensions_dir,
            stale_lock_message,
            stale_trainer_locks,
        )

        # the model's meta build is left to the ranks (validate's docstring)
        try:
            checked = _validate_once(lambda r, w: validate(r, w, build_model=False), run, run["nproc"], announce=True)
        except HDETConfigError as e:  # the world is nproc's here: said in its terms
            from hdet_scale.train.validate import in_nproc_terms

            raise in_nproc_terms(e, run["nproc"], _sets_nproc(path, overrides)) from None
        from hdet_scale.train.run_lock import hold_run_dir

        hold_run_dir(run["run_dir"])  # one job per run_dir; released when this launcher ends
        print_engine_notes(run, path, overrides)
        print_resume_notice(run, checked)
        if run["wandb"]["enabled"]:
            from hdet_scale.wandb_server import refuse_unreachable

            refuse_unreachable(run["wandb"]["mode"])  # rank 0 would find it 40-64 s later
        if run["backend"] == "deepspeed":
            check_extensions_dir()  # before stale_trainer_locks looks inside it
            stale = stale_trainer_locks()
            if stale:
                print(f"hdet-train: error: {stale_lock_message(stale[0])}", file=sys.stderr)
                return STALE_LOCK_EXIT
    except (HDETConfigError, HDETStateError) as e:
        if checking:
            refusals.remember(argv, str(e))
        if not quiet:
            print(f"hdet-train: error: {e}", file=sys.stderr)
        else:
            refusals.wait_for_rank0()
        return _USER_ERROR
    except KeyboardInterrupt:  # Ctrl-C while the config is read and checked: nothing trained yet
        if not launched:
            print("hdet-train: stopped by SIGINT (Ctrl-C) before any rank started", file=sys.stderr)
        elif os.environ.get("RANK", "0").strip() == "0":  # the launcher signals every rank: one line
            print("hdet-train: stopped by SIGINT (Ctrl-C) during start-up, before the first step",
                  file=sys.stderr)
        return 128 + signal.SIGINT
    except StoppedBeforeStart as e:
        print(e.line(), file=sys.stderr)
        return 128 + e.signum
    finally:
        for sig in (signal.SIGTERM, signal.SIGHUP):
            if signal.getsignal(sig) is raise_stop:
                signal.signal(sig, signal.SIG_DFL)  # launch_local sets its own
    from hdet_scale.train.launcher import launch_local

    return launch_local(run)


if __name__ == "__main__":
    sys.exit(main())
