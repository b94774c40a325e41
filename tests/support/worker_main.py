"""Entry point of one test worker: python worker_main.py SCENARIO FUNC ARGS OUT INIT."""

import importlib.util
import pickle
import sys
import traceback


def main() -> int:
    scenario, func, args_file, out, init = sys.argv[1:6]
    report: dict = {}
    code = 0
    hvd = None
    try:
        spec = importlib.util.spec_from_file_location("scenario", scenario)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        with open(args_file, "rb") as f:
            args = pickle.load(f)
        import hora.torch as hvd

        if init == "1":
            hvd.init()
        report["value"] = getattr(module, func)(*args)
    except BaseException as exc:  # noqa: BLE001 - report everything to the test
        report.update(error_type=type(exc).__name__, error=str(exc),
                      error_mro=[c.__name__ for c in type(exc).__mro__],
                      traceback=traceback.format_exc())
        code = 1
    with open(out + ".tmp", "wb") as f:
        pickle.dump(report, f)
    import os

    os.replace(out + ".tmp", out)
    if hvd is not None and code == 0:
        hvd.shutdown()
    return code


if __name__ == "__main__":
    sys.exit(main())
