"""`make run` as a network attacker sees it: nothing it starts listens beyond loopback, Ray's job APIs
and clients without the cluster's token are refused, and the token is in no log.

One real supervisor (scripts/run.py from a copy of this checkout, as tests/platform/test_run_supervisor.py
starts it) is shared by the module, with no Ray token anywhere in its environment or home (Ray turns
token authentication on by itself only when ~/.ray/auth_token exists). Requests go only to
addresses of this machine that the run's own sockets are bound to.
"""

from __future__ import annotations

import http.client
import importlib.util
import ipaddress
import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import psutil
import pytest

from tests.platform.supervisor_harness import (
    ROOT,
    free_port,
    kill_leftovers,
    make_checkout_copy,
    start_run,
    stop_and_time,
)
from webapp.listeners import Listener, is_loopback, listening

pytestmark = pytest.mark.timeout(900)

RAY_CREDENTIALS = ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH")


@pytest.fixture(scope="module")
def run():
    checkout = make_checkout_copy()
    with pytest.MonkeyPatch.context() as patch:
        for name in RAY_CREDENTIALS:
            patch.delenv(name, raising=False)
        # The run's token file goes under the test's own state home, so it is found and removed with it.
        patch.setenv("XDG_STATE_HOME", str(checkout.parent / "state-home"))
        try:
            started = start_run(checkout)
        except BaseException:
            shutil.rmtree(checkout.parent, ignore_errors=True)
            raise
    try:
        yield started
    finally:
        if started.process.poll() is None:
            started.process.send_signal(signal.SIGKILL)
            started.process.wait()
        kill_leftovers(started)
        shutil.rmtree(checkout.parent, ignore_errors=True)


def _run_pids(run) -> list[int]:
    return [int(line.split()[0]) for line in run.leftovers()]


def _listeners(run) -> list[Listener]:
    return listening(_run_pids(run))


def _ray_listeners(run, marker: str, *, timeout: float = 90.0) -> list[Listener]:
    """The listeners of the run's processes whose command line contains ``marker``, once there are any."""
    deadline = time.monotonic() + timeout
    while True:
        found = [item for item in _listeners(run) if marker in item.process and item.proto == "tcp"]
        if found or time.monotonic() > deadline:
            return found
        time.sleep(1)


def _local_target(listener: Listener) -> str:
    """Where to reach a socket without leaving this machine: loopback for a wildcard bind, else the
    bound address itself, which must be one of this machine's own."""
    ip = ipaddress.ip_address(listener.address)
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    if ip.is_unspecified:
        ip = ipaddress.ip_address("127.0.0.1" if ip.version == 4 else "::1")
    own = {addr.address.split("%")[0] for addrs in psutil.net_if_addrs().values() for addr in addrs}
    assert ip.is_loopback or str(ip) in own, f"{listener.describe()} is bound to an address this machine lacks"
    return f"[{ip}]" if ip.version == 6 else str(ip)


def test_nothing_of_the_run_listens_beyond_loopback(run):
    # Every server of the run, Ray's agents (the last to come up) included, so the check sees them all;
    # on a loaded machine the raylet may give up waiting for its agents and the head be restarted.
    servers = (f"--port {run.port}", "gcs_server", "raylet", "DashboardAgent", "RuntimeEnv", "client.server")
    deadline = time.monotonic() + 240
    while True:
        found = _listeners(run)
        missing = [server for server in servers if not any(server in item.process for item in found)]
        if not missing or time.monotonic() > deadline:
            break
        time.sleep(2)
    print("listening:\n" + "\n".join(item.describe() for item in found))
    assert not missing, f"no socket of {missing} seen: the check saw too little\n{run.log()[-3000:]}"
    exposed = [item.describe() for item in found if not is_loopback(item.address)]
    assert not exposed, "listening beyond loopback:\n" + "\n".join(exposed)


def _post_job(url: str, marker: Path) -> str:
    body = json.dumps({"entrypoint": f"id > {marker}", "submission_id": f"attacker-{marker.name}"}).encode()
    request = urllib.request.Request(url, data=body, method="POST", headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return f"{response.status}"
    except urllib.error.HTTPError as error:
        return f"{error.code}"
    except (OSError, http.client.HTTPException) as error:  # not HTTP (a gRPC port), closed, reset: no job
        return f"no HTTP ({type(error).__name__})"


def _agent_job_api(run, *, timeout: float = 180.0) -> Listener | None:
    """The dashboard agent's HTTP port (its job API), found by its public health check once it is up."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for listener in _ray_listeners(run, "DashboardAgent"):
            try:
                url = f"http://{_local_target(listener)}:{listener.port}/api/healthz"
                with urllib.request.urlopen(url, timeout=5) as response:
                    # The agent's own answer ("raylet: success ..."), not its metrics port's (any path).
                    if response.status == 200 and response.read(200).startswith(b"raylet:"):
                        return listener
            except (OSError, http.client.HTTPException):
                continue
        time.sleep(2)
    return None


def test_rays_job_apis_refuse_a_submission_without_the_token(run, tmp_path):
    job_api = _agent_job_api(run)
    assert job_api is not None, "the dashboard agent's HTTP server never came up"
    answers = {}
    for listener in _listeners(run):
        if listener.proto != "tcp" or listener.port == run.port:
            continue
        for path in ("/api/job_agent/jobs/", "/api/jobs/"):
            marker = tmp_path / f"ran-{listener.port}-{path.strip('/').replace('/', '-')}"
            url = f"http://{_local_target(listener)}:{listener.port}{path}"
            answers[(listener, path)] = (_post_job(url, marker), marker)
    time.sleep(10)  # a job that was accepted has had its time to run `id`
    report = "\n".join(f"{item.describe()} POST {path}: {answer}" for (item, path), (answer, _) in answers.items())
    print(report)
    ran = [marker.read_text() for _, marker in answers.values() if marker.exists()]
    assert not ran, f"a job ran without the token: {ran}\n{report}"
    assert not [answer for answer, _ in answers.values() if answer.startswith("2")], report
    # The agent's job API refuses the request as unauthenticated, before looking at it.
    assert answers[(job_api, "/api/job_agent/jobs/")][0] in ("401", "403"), report


ATTACKER = r"""
import sys
import ray

for address in sys.argv[1:]:
    try:
        ray.init(address=address, log_to_driver=False)
        print("CONNECTED", address, flush=True)
        print("RESULT", ray.get(ray.remote(lambda: "REMOTE-RAN").remote(), timeout=60), flush=True)
    except BaseException as error:
        print("REFUSED", address, type(error).__name__, str(error)[:200], flush=True)
    finally:
        ray.shutdown()
"""


def test_ray_clients_without_the_token_are_refused(run, tmp_path):
    gcs = (run.state_dir / "ray_address").read_text().strip()
    client_servers = _ray_listeners(run, "ray.util.client.server")
    addresses = [gcs] + [f"ray://{_local_target(item)}:{item.port}" for item in client_servers]
    # No token anywhere: none in the environment, and a home without ~/.ray/auth_token. Ray's
    # single-machine mode, so that the driver dials 127.0.0.1 as asked instead of the machine's address.
    env = {key: value for key, value in os.environ.items() if not key.startswith("RAY_")}
    env.update(HOME=str(tmp_path), RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0")
    outputs = []
    for address in addresses:
        try:
            result = subprocess.run([sys.executable, "-c", ATTACKER, address], cwd=tmp_path, env=env,
                                    capture_output=True, text=True, timeout=120)
            outputs.append(result.stdout + result.stderr[-1500:])
        except subprocess.TimeoutExpired as expired:  # hanging at the door is no way in either
            outputs.append(f"{address}: timed out: {str(expired.stdout)[-500:]} {str(expired.stderr)[-1000:]}")
    output = "\n".join(outputs)
    print(output)
    assert "REMOTE-RAN" not in output, output
    assert "CONNECTED" not in output, output


def _cmdline(pid: int) -> list[str]:
    try:
        return psutil.Process(pid).cmdline()
    except psutil.Error:
        return []


def _environ(pid: int) -> dict[str, str]:
    try:
        return psutil.Process(pid).environ()
    except psutil.Error:
        return {}


def _files(root: Path):
    for path in root.rglob("*"):
        try:
            if path.is_file() and not path.is_symlink() and stat.S_ISREG(path.stat().st_mode):
                yield path
        except OSError:
            continue


def test_the_ray_token_is_private_and_in_no_log(run):
    gcs = next(pid for pid in _run_pids(run) if "gcs_server" in " ".join(_cmdline(pid)))
    environment = _environ(gcs)
    assert environment.get("RAY_AUTH_MODE") == "token", f"Ray's GCS runs with RAY_AUTH_MODE={environment.get('RAY_AUTH_MODE')}"
    token_path = Path(environment.get("RAY_AUTH_TOKEN_PATH", "/nonexistent"))
    assert token_path.is_file(), f"the Ray head was started without a token file ({token_path})"
    assert not token_path.resolve().is_relative_to(run.checkout.resolve())
    assert stat.S_IMODE(token_path.stat().st_mode) == 0o600
    assert stat.S_IMODE(token_path.parent.stat().st_mode) == 0o700
    token = token_path.read_text().strip()
    assert len(token) >= 32
    places = [run.log_path, *_files(run.state_dir)]
    outside = run.state_dir / "ray_temp_dir"
    if outside.is_file():
        places += list(_files(Path(outside.read_text().strip())))
    leaked = [str(path) for path in places if token.encode() in path.read_bytes()]
    assert not leaked, f"the Ray token is written in: {leaked}"
    in_environment = [str(pid) for pid in _run_pids(run) if token in _environ(pid).values()]
    assert not in_environment, f"the token itself is in the environment of {in_environment}"


def test_the_runs_own_ray_client_connects_with_the_token(run):
    """fleet_serve (a Ray driver, like the experiment drivers the Celery worker starts, with the same
    inherited environment) joins the authenticated head and places its sandbox host actor (after a
    restart, when a loaded machine made the head restart under it)."""
    deadline = time.monotonic() + 180
    while "fleet running:" not in run.log() and time.monotonic() < deadline:
        time.sleep(2)
    assert "fleet running:" in run.log(), run.log()[-3000:]


def test_the_stop_removes_the_token_file(run):
    token_path = run.checkout.parent / "state-home" / "flowstate"
    assert list(token_path.glob("ray-*/auth_token")), "no token file under the run's state home"
    _, left = stop_and_time(run, "sigint")
    assert not left, left
    assert run.process.wait(timeout=10) == 0, run.log()[-3000:]
    assert not list(token_path.glob("ray-*/auth_token"))


LISTENER = """
import socket, sys, time
sock = socket.socket(socket.AF_INET6 if ':' in sys.argv[1] else socket.AF_INET)
sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
sock.bind((sys.argv[1], int(sys.argv[2])))
sock.listen(1)
print('listening', flush=True)
time.sleep(120)
"""


def _supervisor_module(monkeypatch, **env):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    spec = importlib.util.spec_from_file_location("flowstate_run_under_test", ROOT / "scripts" / "run.py")
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def _child_listening(address: str, port: int) -> subprocess.Popen:
    child = subprocess.Popen([sys.executable, "-c", LISTENER, address, str(port)], stdout=subprocess.PIPE, text=True)
    assert child.stdout.readline().strip() == "listening"
    return child


@pytest.mark.parametrize("address", ["0.0.0.0", "::"])
def test_the_supervisor_refuses_a_child_listening_beyond_loopback(monkeypatch, tmp_path, address):
    """A child of the supervisor (here, of this process) bound to every interface stops the run, with
    its pid and port named; the same on loopback, or as the operator's own FLOWSTATE_HOST, does not."""
    port = free_port()
    supervisor = _supervisor_module(monkeypatch, FLOWSTATE_STATE_DIR=str(tmp_path / "var"))
    child = _child_listening(address, port)
    try:
        with pytest.raises(SystemExit, match=rf"refusing to run: listening beyond loopback: .*pid {child.pid}\) "
                                             rf"on tcp \[?{address}\]?:{port}"):
            supervisor.check_exposure()
        operator = _supervisor_module(monkeypatch, FLOWSTATE_STATE_DIR=str(tmp_path / "var"),
                                      FLOWSTATE_HOST=address, FLOWSTATE_PORT=str(port))
        operator.check_exposure()  # the address and port the operator asked uvicorn to serve on
        other_port = _supervisor_module(monkeypatch, FLOWSTATE_STATE_DIR=str(tmp_path / "var"),
                                        FLOWSTATE_HOST=address, FLOWSTATE_PORT=str(free_port()))
        with pytest.raises(SystemExit, match=rf"pid {child.pid}\)"):
            other_port.check_exposure()  # the exception is that one server socket, not the address
    finally:
        child.kill()
        child.wait()
    monkeypatch.delenv("FLOWSTATE_HOST")
    loopback = _child_listening("127.0.0.1", free_port())
    try:
        supervisor.check_exposure()
    finally:
        loopback.kill()
        loopback.wait()
