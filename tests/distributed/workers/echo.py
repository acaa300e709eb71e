"""Target of the prewarm tests: prints what it was started with (argv, cwd, one variable, pid, parent pid) as
one JSON line, then, with ECHO_SLEEP set, writes its pid to ECHO_PIDFILE and sleeps; exits with ECHO_CODE."""

from __future__ import annotations

import json
import os
import sys
import time

if __name__ == "__main__":
    print(json.dumps({"argv": sys.argv[1:], "cwd": os.getcwd(), "var": os.environ.get("ECHO_VAR"), "pid": os.getpid(),
                      "ppid": os.getppid()}), flush=True)
    if os.environ.get("ECHO_SLEEP"):
        with open(os.environ["ECHO_PIDFILE"], "w") as f:
            f.write(str(os.getpid()))
        time.sleep(float(os.environ["ECHO_SLEEP"]))
    sys.exit(int(os.environ.get("ECHO_CODE", "0")))
