"""`python tests/fault_worker.py FAULT vlrft-args...`: run the vlrft CLI with one injected fault (a real SIGKILL).

FAULT is one of:
  none                      run normally
  kill-in-save:<step>       SIGKILL this process while it writes checkpoint <step> (after the weights, before the
                            optimizer state)
  kill-in-prune             SIGKILL this process while keep-last pruning deletes an old checkpoint
  kill-in-log:<step>        SIGKILL this process halfway through writing step <step>'s metrics line (a torn line)
"""

import os
import signal
import sys


def _die():
    os.kill(os.getpid(), signal.SIGKILL)


def install(fault: str) -> None:
    kind, _, arg = fault.partition(":")
    if kind == "none":
        return
    from vlrft.trainer import checkpoint

    if kind == "kill-in-save":
        real_save = checkpoint.torch.save

        def save(obj, path, *args, **kwargs):
            if f".tmp-step_{arg}" in str(path) and str(path).endswith("optimizer.pt"):
                _die()
            return real_save(obj, path, *args, **kwargs)

        checkpoint.torch.save = save
    elif kind == "kill-in-prune":
        real_rmtree = checkpoint.shutil.rmtree

        def rmtree(path, *args, **kwargs):
            if os.path.basename(str(path)).startswith(".deleting-step_") and os.path.isdir(path):
                for child in sorted(os.listdir(path))[:1]:  # half-deleted, then killed
                    target = os.path.join(path, child)
                    real_rmtree(target) if os.path.isdir(target) else os.unlink(target)
                _die()
            return real_rmtree(path, *args, **kwargs)

        checkpoint.shutil.rmtree = rmtree
    elif kind == "kill-in-log":
        from vlrft import logging as run_logging

        real_log = run_logging.RunLogger.log

        def log(self, step, metrics):
            if step == int(arg):
                with self.metrics_path.open("a") as f:
                    f.write('{"step": %d, "reward/me' % step)
                    f.flush()
                _die()
            return real_log(self, step, metrics)

        run_logging.RunLogger.log = log
    else:
        raise SystemExit(f"unknown fault {fault!r}")


if __name__ == "__main__":
    install(sys.argv[1])
    from vlrft.cli import main

    sys.exit(main(sys.argv[2:]))
