"""A stand-in inference server process for launch tests (run as a script, never imported).

Serves GET /health_generate (503 until --ready-after seconds, then 200) on --port, or
misbehaves at start-up as asked: exit with a code, SIGKILL itself, never become ready.
--spawn writes the pids of a child, an orphaned grandchild and (--stubborn) a
SIGTERM-ignoring child to --pid-file, so a test can check that teardown ends the whole tree.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from http.server import BaseHTTPRequestHandler, HTTPServer

SLEEPER = "import time\nwhile True: time.sleep(1)"
SLEEPER_IGNORING_TERM = "import signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\nwhile True: time.sleep(1)"
# A middle process that starts a sleeper and exits, orphaning it (reparented away from our tree).
ORPHANER = ("import subprocess, sys\n"
            "p = subprocess.Popen([sys.executable, '-c', 'import time\\nwhile True: time.sleep(1)'],\n"
            "                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)\n"
            "print(p.pid, flush=True)\n")


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--ready-after", type=float, default=0.0)
    parser.add_argument("--exit-code", type=int, default=None)
    parser.add_argument("--self-kill", action="store_true")
    parser.add_argument("--never-ready", action="store_true")
    parser.add_argument("--spawn", action="store_true")
    parser.add_argument("--stubborn", action="store_true", help="with --spawn: also a SIGTERM-ignoring child")
    parser.add_argument("--pid-file", default=None)
    args = parser.parse_args()

    print(f"fake engine starting on port {args.port}", flush=True)
    if args.exit_code is not None:
        print("RuntimeError: fake engine could not load the model", file=sys.stderr, flush=True)
        time.sleep(0.2)
        return args.exit_code
    if args.self_kill:
        print("allocating KV cache ...", flush=True)
        time.sleep(0.2)
        os.kill(os.getpid(), signal.SIGKILL)

    if args.spawn:
        pids = [subprocess.Popen([sys.executable, "-c", SLEEPER]).pid]
        middle = subprocess.run([sys.executable, "-c", ORPHANER], capture_output=True, text=True, timeout=30)
        pids.append(int(middle.stdout.strip()))
        if args.stubborn:
            pids.append(subprocess.Popen([sys.executable, "-c", SLEEPER_IGNORING_TERM]).pid)
        with open(args.pid_file, "w") as fh:
            fh.write(" ".join(map(str, pids)) + "\n")

    started = time.monotonic()

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, format: str, *a: object) -> None:
            pass

        def do_GET(self) -> None:
            ready = not args.never_ready and time.monotonic() - started >= args.ready_after
            self.send_response(200 if ready and self.path == "/health_generate" else 503)
            self.send_header("Content-Length", "0")
            self.end_headers()

    HTTPServer(("127.0.0.1", args.port), Handler).serve_forever()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
