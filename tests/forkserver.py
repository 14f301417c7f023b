"""Test-only: Python processes that start without their imports, for torchrun's workers and command-line tests.

A fresh `python -u script` here spends ~6 CPU-s importing torch, torchvision and transformers' GPT-2 before 1-2 CPU-s
of work, and the suite starts about 20 of them. A server (`serve SOCKET`) imports those third-party modules once and
waits. `python tests/forkserver.py run SOCKETS script args...` (what conftest.torchrun hands torchrun, with
--no-python, in each worker's place; conftest.run_python runs it for a command-line test) sends the server of its
rank (LOCAL_RANK) its argv, environment, working folder and standard streams; the server forks a child that runs the
script as `python -u script args` would: as __main__, with a fresh interpreter's sys.path (the script's folder, then
$PYTHONPATH), importing this project's modules (common.py, sandbox.py) itself. The client stays the process torchrun
watches: it passes SIGTERM and SIGINT on, and exits as the child did (killed by a signal, by the same signal); killed
itself, its child is killed with it. A server per rank: ranks differ in their hash seeds, as fresh processes do.

What a fork does not give: the libraries read some variables once, when they load (READ_AT_LOAD: the server has
conftest's torchrun environment, and refuses a request that sets them otherwise), and warnings the preloaded modules
print at import were printed by the server. So a test of what a fresh process prints or imports, or of torchrun's
own start of its workers, starts real processes (tests/test_cli.py, test_generate.py, test_running.py)."""

import json
import os
import select
import signal
import socket
import struct
import sys

# Read by the libraries when they load, so fixed for the server's life: a request must match the server's.
READ_AT_LOAD = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "MKL_CBWR", "ATEN_CPU_CAPABILITY", "CUDA_VISIBLE_DEVICES")
# Third-party modules only: the child imports this project's own modules itself, from its own sys.path.
PRELOAD = ("torch", "torch.distributed", "torchvision", "transformers", "transformers.models.gpt2.modeling_gpt2")
BASE_PATH = list(sys.path[1:])  # a fresh interpreter's sys.path after its script's folder and $PYTHONPATH


def send_message(sock: socket.socket, obj, fds=()):
    data = json.dumps(obj).encode()
    socket.send_fds(sock, [struct.pack("!I", len(data)) + data], list(fds))


def receive_message(sock: socket.socket, n_fds=0):
    head, fds, _, _ = socket.recv_fds(sock, 4, n_fds)
    if len(head) < 4:
        return None, fds
    (size,) = struct.unpack("!I", head)
    data = b""
    while len(data) < size:
        chunk = sock.recv(size - len(data))
        if not chunk:
            return None, fds
        data += chunk
    return json.loads(data), fds


# ---- the server ---------------------------------------------------------------------------------------------------
def serve(path: str):
    """Import PRELOAD, listen at `path`, fork a child per request; report each child's exit status to its client."""
    import importlib
    import logging
    import warnings

    assert "PYTHONPATH" not in os.environ, "the server's path must be a fresh interpreter's (BASE_PATH)"
    handlers = list(logging.getLogger().handlers)
    for name in PRELOAD:
        importlib.import_module(name)
    catch_all = [f for f in warnings.filters if f[0] == "ignore" and f[1:4] == (None, Warning, None)]
    assert not catch_all and logging.getLogger().handlers == handlers, "an import silenced warnings or logging"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path + ".tmp")
    listener.listen(16)
    os.rename(path + ".tmp", path)  # the path appears once the imports are done (conftest.forkservers waits for it)
    children, parent = {}, os.getppid()  # children: client connection -> child pid
    while os.getppid() == parent:  # the pytest process that started it is alive
        ready, _, _ = select.select([listener, *children], [], [], 0.05)
        for conn in ready:
            if conn is listener:
                client, _ = listener.accept()
                request, fds = receive_message(client, 3)
                refused = request and [k for k in READ_AT_LOAD if request["env"].get(k) != os.environ.get(k)]
                if not request or refused:
                    send_message(client, {"refused": refused or "no request"})
                    client.close()
                else:
                    children[client] = start_child(request, fds, listener, client, *children)
                for fd in fds:
                    os.close(fd)
            else:  # a signal to pass on, or the client gone (killed): its child goes with it
                message, _ = receive_message(conn)
                os.kill(children[conn], message["signal"] if message else signal.SIGKILL)
        for conn, pid in list(children.items()):
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                code = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
                try:
                    send_message(conn, {"exit": code})
                except OSError:  # the client is gone
                    pass
                conn.close()
                del children[conn]


def start_child(request: dict, fds: list[int], *sockets: socket.socket) -> int:
    """Fork; in the child: the client's streams, environment and folder, the server's sockets closed, then the run."""
    pid = os.fork()
    if pid:
        return pid
    for s in sockets:
        s.close()
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
    for fd in fds:
        os.close(fd)
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    code = run_as_main(request["argv"])
    end_as(code)
    os._exit(code)


def end_as(code: int):
    """A negative status is a death by that signal, as Python reports it: die by the same signal."""
    if code < 0:
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)


def run_as_main(argv: list[str]) -> int:
    """`python -u argv[0] argv[1:]`: the script as __main__, its folder first on the path; its exit status."""
    import atexit
    import runpy

    sys.argv = list(argv)
    pythonpath = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[:] = [os.path.dirname(os.path.abspath(argv[0])), *pythonpath, *BASE_PATH]
    code = 0
    try:
        runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            code = e.code or 0
        else:
            print(e.code, file=sys.stderr)
            code = 1
    except KeyboardInterrupt as e:  # as Python exits on it: its traceback, killed by SIGINT
        print_traceback(e)
        code = -signal.SIGINT
    except Exception as e:  # noqa: BLE001 (any error: as Python exits on one, its traceback and status 1)
        print_traceback(e)
        code = 1
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    return code


def print_traceback(e: BaseException):
    """The traceback Python prints, from the script's first frame (without this file's and runpy's)."""
    import traceback

    tb = e.__traceback__
    while tb and tb.tb_frame.f_code.co_filename in (__file__, "<frozen runpy>"):
        tb = tb.tb_next
    traceback.print_exception(type(e), e, tb)


# ---- the client ---------------------------------------------------------------------------------------------------
def run(sockets: str, argv: list[str]) -> int:
    """Have the server of this process's rank (LOCAL_RANK, 0 without torchrun) run argv; its exit status."""
    paths = sockets.split(",")
    path = paths[int(os.environ.get("LOCAL_RANK", "0")) % len(paths)]  # there once its imports are done
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.connect(path)
    send_message(conn, {"argv": argv, "env": dict(os.environ), "cwd": os.getcwd()}, fds=(0, 1, 2))

    def pass_on(number, frame):
        try:
            send_message(conn, {"signal": number})
        except OSError:  # the child has exited and the server said so
            pass

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, pass_on)
    answer, _ = receive_message(conn)
    if answer is None or "refused" in answer:
        sys.exit(f"forkserver: {path} refused the request ({answer and answer['refused']})")
    end_as(answer["exit"])
    return answer["exit"]


if __name__ == "__main__":
    if sys.argv[1] == "serve":
        serve(sys.argv[2])
    else:
        sys.exit(run(sys.argv[2], sys.argv[3:]))
