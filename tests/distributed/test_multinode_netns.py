"""Two hosts on one machine: two network namespaces the test makes, joined by a veth pair
(10.231.0.1/24 and 10.231.0.2/24, addresses that exist only inside them), each with its own
loopback and its hostname resolving to 127.0.1.1 as on a stock Debian / Ubuntu machine (an
/etc/netns/NAME/hosts that `ip netns exec` mounts over /etc/hosts). Node 0 runs as this file's
`__main__` in the first, node 1 as `sparkserve serve --node-rank 1` in the second.

- TP=2 over the two hosts gives one process' greedy tokens and logprobs (gloo advertises the
  address of the interface that routes to --dist-init-addr, not the hostname's loopback one);
- a node 1 that never starts fails node 0 within --dist-timeout, naming rank 1;
- a mesh that cannot connect (loopback forced by GLOO_SOCKET_IFNAME / --dist-socket-ifname)
  fails both nodes at once, naming the address and the settings;
- --dist-init-addr on a wildcard or public address is refused unless --dist-allow-public-bind;
- the interface finder, inside the namespaces and out;
- PD: a prefill server on one host, a decode server and `sparkserve router` on the other, give
  the prefill server's own greedy answers.

Skipped only where the `ip` tool (iproute2) is missing or network namespaces are not permitted."""
from __future__ import annotations

import contextlib
import itertools
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import dataclass

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
NODE0_IP, NODE1_IP = "10.231.0.1", "10.231.0.2"
PORT = 29500                      # inside the test's own namespaces: nothing else listens there
ADDR = f"{NODE0_IP}:{PORT}"
# One torch thread a process; the fp32 layers (no C++ kernels to build on a fresh machine)
ENV = dict(os.environ, OMP_WAIT_POLICY="PASSIVE", PYTHONUNBUFFERED="1", SPARKSERVE_DISABLE_KERNELS="1")
ENV.pop("GLOO_SOCKET_IFNAME", None)
COMMON = dict(num_threads=1, chunked_prefill_size=16, max_total_tokens=2048)
_serial = itertools.count()


def _ip(*args: str) -> None:
    r = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if r.returncode:
        raise RuntimeError(f"ip {' '.join(args)}: {r.stderr.strip()}")


@dataclass
class Hosts:
    a: str              # node 0's namespace
    b: str              # node 1's
    veth_a: str
    veth_b: str

    def run(self, ns: str, *cmd: str, env: dict | None = None, **kw) -> subprocess.Popen:
        return subprocess.Popen(["ip", "netns", "exec", ns, *cmd], cwd=ROOT, env=env or ENV,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **kw)


@pytest.fixture
def hosts():
    if shutil.which("ip") is None:
        pytest.skip("the `ip` tool (iproute2) is not installed: no network namespaces to run two hosts in")
    tag = f"ss{os.getpid() % 100000}x{next(_serial)}"          # unique per test process and test
    a, b = f"{tag}a", f"{tag}b"
    made: list[str] = []
    try:
        for ns in (a, b):
            try:
                _ip("netns", "add", ns)
            except RuntimeError as e:
                if "not permitted" in str(e).lower() or "permission denied" in str(e).lower():
                    pytest.skip(f"network namespaces are not permitted here ({e})")
                raise
            made.append(ns)
            os.makedirs(f"/etc/netns/{ns}", exist_ok=True)
            with open(f"/etc/netns/{ns}/hosts", "w") as f:   # a stock machine's: hostname -> 127.0.1.1
                f.write(f"127.0.0.1 localhost\n127.0.1.1 {socket.gethostname()}\n")
        va, vb = f"{tag}va", f"{tag}vb"
        _ip("link", "add", va, "type", "veth", "peer", "name", vb)
        for ns, veth, ip in ((a, va, NODE0_IP), (b, vb, NODE1_IP)):
            _ip("link", "set", veth, "netns", ns)
            _ip("-n", ns, "addr", "add", f"{ip}/24", "dev", veth)
            _ip("-n", ns, "link", "set", veth, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
        yield Hosts(a, b, va, vb)
    finally:
        for ns in made:                    # the veth pair goes with its namespaces
            with contextlib.suppress(Exception):
                _ip("netns", "del", ns)
            shutil.rmtree(f"/etc/netns/{ns}", ignore_errors=True)


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> str:
    from conftest import make_tiny_checkpoint
    return make_tiny_checkpoint("llama", str(tmp_path_factory.mktemp("netns") / "llama"))


def _node1(hosts: Hosts, model: str, *extra: str) -> subprocess.Popen:
    return hosts.run(hosts.b, sys.executable, "-m", "sparkserve", "serve", "--node-rank", "1",
                     "--model-path", model, "--tp-size", "2", "--nnodes", "2", "--dist-init-addr", ADDR,
                     "--num-threads", "1", "--chunked-prefill-size", "16", "--max-total-tokens", "2048",
                     *extra)


def _node0(hosts: Hosts, model: str, mode: str, timeout_s: float, env: dict | None = None,
           dist_timeout: float = 30) -> tuple[dict, float]:
    """This file as node 0 in the first namespace: its JSON answer, and how long it took."""
    t0 = time.monotonic()
    proc = hosts.run(hosts.a, sys.executable, os.path.abspath(__file__), mode, model, str(dist_timeout),
                     env=env)
    try:
        out, _ = proc.communicate(timeout=timeout_s)
    finally:
        proc.kill()
    lines = [ln for ln in out.splitlines() if ln.startswith("{")]
    assert lines, f"node 0 printed no answer (exit {proc.returncode}):\n{out[-3000:]}"
    return json.loads(lines[-1]), time.monotonic() - t0


def _finish(proc: subprocess.Popen, timeout: float) -> tuple[int, str]:
    try:
        out, _ = proc.communicate(timeout=timeout)
    finally:
        proc.kill()
    return proc.returncode, out


def test_tp2_over_two_hosts_equals_one_process(hosts, llama):
    node1 = _node1(hosts, llama, "--dist-timeout", "60")
    try:
        answer, _ = _node0(hosts, llama, "serve", timeout_s=100)
        code, log = _finish(node1, 60)
    finally:
        node1.kill()
    assert "error" not in answer, answer.get("error")
    assert code == 0, log[-3000:]
    from parallel_fixtures import assert_same
    assert_same(answer["got"], answer["want"])


def test_node1_never_starts_fails_fast_naming_it(hosts, llama):
    answer, took = _node0(hosts, llama, "serve", timeout_s=45, dist_timeout=8)
    err = answer.get("error", "")
    assert "rank 1 (node 1) never joined" in err and "--dist-timeout 8s" in err and ADDR in err, answer
    assert "--node-rank" in err
    assert took < 40, took


def test_mesh_that_cannot_connect_fails_fast_naming_address_and_settings(hosts, llama):
    """Both nodes forced onto loopback: every rank reaches the rendezvous but not the other's
    gloo address, so both fail within moments instead of gloo retrying or waiting."""
    node1 = _node1(hosts, llama, "--dist-socket-ifname", "lo", "--dist-timeout", "30")
    try:
        answer, took = _node0(hosts, llama, "serve", timeout_s=45, env=dict(ENV, GLOO_SOCKET_IFNAME="lo"))
        code, log = _finish(node1, 30)
    finally:
        node1.kill()
    err = answer.get("error", "")
    assert "could not reach rank 1 (node 1" in err and "at 127.0.0.1" in err, answer
    assert "--dist-socket-ifname lo" in err and "GLOO_SOCKET_IFNAME" in err and "--dist-init-addr" in err
    assert took < 30, took
    assert code != 0 and "the ranks cannot connect" in log, log[-3000:]


def test_public_or_wildcard_rendezvous_is_refused(monkeypatch):
    from sparkserve.args import ServerArgs
    from sparkserve.distributed import interface
    from sparkserve.distributed import parallel_state as ps

    def args(addr: str, **kw):
        return ServerArgs(tp_size=2, nnodes=2, dist_init_addr=addr, **kw).validate()

    for addr in ("0.0.0.0:29500", "8.8.8.8:29500", "[::]:29500", "[2001:4860::1]:29500"):
        with pytest.raises(ValueError, match="--dist-allow-public-bind") as e:
            args(addr)
        assert "pickled" in str(e.value)
    for addr in ("10.0.0.1:5000", "192.168.1.2:5000", "172.16.0.1:5000", "127.0.0.1:5000", "[fd00::1]:5000",
                 "[::1]:5000", "node0:5000"):
        args(addr)                           # SGLang's usual multi-node flags still start
    args("0.0.0.0:29500", dist_allow_public_bind=True)
    with pytest.raises(ValueError, match="give HOST:PORT"):
        args("node0")
    # A name is checked once resolved, before anything listens or connects.
    monkeypatch.setattr(interface, "resolve", lambda host: "8.8.8.8")
    cfg = args("node0.example:29500").parallel_config()
    with pytest.raises(ValueError, match=r"node0.example \(8.8.8.8\) is a globally routable address"):
        ps.init_distributed(cfg, 0, "node0.example:29500", 5)
    # And on the command line, at once.
    r = subprocess.run([sys.executable, "-m", "sparkserve", "serve", "--tp-size", "2", "--nnodes", "2",
                        "--dist-init-addr", "0.0.0.0:29500"], capture_output=True, text=True, timeout=60,
                       cwd=ROOT, env=ENV)
    assert r.returncode != 0 and "--dist-allow-public-bind" in r.stdout + r.stderr


def test_interface_finder_outside_namespaces(monkeypatch):
    from sparkserve.addresses import split_host_port
    from sparkserve.disaggregation import registered
    from sparkserve.distributed import interface

    assert registered.local_ip is interface.local_ip              # one rule for PD and the ranks
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    assert interface.local_ip("127.0.0.1") == "127.0.0.1"
    assert interface.local_ip("no-such-host.invalid") == "127.0.0.1"
    assert interface.gloo_interface("127.0.0.1").ifname is None  # one node on loopback: as before
    assert interface.interface_of("127.0.0.1") == "lo"
    assert "127.0.0.1" in interface.interface_addresses()["lo"]
    assert interface.interface_of("192.0.2.123") is None          # TEST-NET: held by no interface here
    assert interface.gloo_addresses("lo") == ["127.0.0.1"]
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    assert interface.gloo_interface("127.0.0.1") == ("lo", "GLOO_SOCKET_IFNAME=lo")
    assert interface.gloo_interface("127.0.0.1", "lo").why == "--dist-socket-ifname lo"   # the flag first
    with pytest.raises(ValueError, match=r"--dist-socket-ifname nosuch0: this host has no interface .*lo"):
        interface.gloo_interface("127.0.0.1", "nosuch0")
    assert split_host_port("[fd00::1]:29500") == ("fd00::1", 29500)
    assert split_host_port("node0:29500") == ("node0", 29500)


def test_rendezvous_store_listens_at_the_init_address_only():
    """torch's TCPStore would listen on every interface of node 0 whatever --dist-init-addr says;
    rank 0's store takes a socket bound to that address (a port in use is named at once)."""
    from server_harness import free_port

    from sparkserve.args import ParallelConfig
    from sparkserve.distributed import rendezvous
    cfg, port = ParallelConfig(tp_size=2), free_port()
    store = rendezvous._open(cfg, 0, "127.0.0.1", port, 5)
    client = rendezvous._open(cfg, 1, "127.0.0.1", port, 5)
    client.set("k", "v")
    assert store.get("k") == b"v"
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.2", port), timeout=5).close()   # loopback, another address
    with pytest.raises(RuntimeError, match=rf"cannot host .* 127.0.0.1:{port}: Address already in use"):
        rendezvous._open(cfg, 0, "127.0.0.1", port, 5)
    del client, store


FINDER = """
import json, socket
from sparkserve.distributed import interface as i
c = i.gloo_interface({peer!r})
print(json.dumps(dict(choice=list(c), local=i.local_ip({peer!r}), of=i.interface_of(i.local_ip({peer!r})),
                      advertised=i.gloo_addresses(c.ifname), default=i.gloo_addresses(None),
                      loop=list(i.gloo_interface("127.0.0.1")))))
"""


def test_interface_finder_in_namespaces(hosts):
    """On either host the ranks take the veth that routes to node 0, whose address is the one
    gloo then advertises; without it, the hostname's 127.0.1.1."""
    for ns, veth, mine in ((hosts.a, hosts.veth_a, NODE0_IP), (hosts.b, hosts.veth_b, NODE1_IP)):
        out, _ = hosts.run(ns, sys.executable, "-c", FINDER.format(peer=NODE0_IP)).communicate(timeout=60)
        got = json.loads(out.splitlines()[-1])
        assert got["choice"][0] == veth and f"leaves through {veth} ({mine})" in got["choice"][1], got
        assert got["local"] == mine and got["of"] == veth and got["advertised"] == [mine]
        assert got["default"] == ["127.0.1.1"] and got["loop"][0] is None


PD_CLIENT = """
import json, sys, time, httpx
prefill, decode, router = sys.argv[1:4]
end = time.monotonic() + 120
for url, path in ((prefill, "/health"), (decode, "/health"), (router, "/v1/models")):
    while True:
        try:
            if httpx.get(url + path, timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        assert time.monotonic() < end, f"{url} never came up"
        time.sleep(0.25)
out = []
for body in json.loads(sys.argv[4]):
    want = httpx.post(prefill + "/generate", json=body, timeout=60).json()      # colocated there
    got = httpx.post(router + "/generate", json=body, timeout=60)
    out.append([want, got.status_code, got.json()])
print(json.dumps(out))
"""


def test_pd_prefill_and_decode_on_two_hosts_equal_colocated(hosts, tmp_path):
    """`--disaggregation-mode prefill` on one host, decode on the other, `sparkserve router` beside
    the decode server: each request's prompt runs on the first host and its decode on the second
    (whose log shows no prefill batch), with the greedy answers of the prefill server alone."""
    from tiny_chat_fixtures import make_tiny_chat_checkpoint
    model = make_tiny_chat_checkpoint(str(tmp_path / "chat"))
    key = "netns-test-secret-0123456789abcdef"
    common = ("--model-path", model, "--max-total-tokens", "2048", "--num-threads", "1", "--log-level",
              "info", "--port", "30000", "--disaggregation-auth-key", key,
              "--disaggregation-bootstrap-timeout", "20")
    prefill_url, decode_url, router_url = (f"http://{NODE0_IP}:30000", f"http://{NODE1_IP}:30000",
                                           "http://127.0.0.1:30001")
    bodies = [{"text": "Once upon a time", "sampling_params": {"max_new_tokens": 8, "temperature": 0}},
              {"text": ["The sky", "Rain is"], "sampling_params": {"max_new_tokens": 6, "temperature": 0}}]
    serve = (sys.executable, "-m", "sparkserve", "serve")
    procs = [hosts.run(hosts.a, *serve, *common, "--host", NODE0_IP, "--disaggregation-mode", "prefill",
                       "--disaggregation-bootstrap-port", "8998"),
             hosts.run(hosts.b, *serve, *common, "--host", NODE1_IP, "--disaggregation-mode", "decode"),
             hosts.run(hosts.b, sys.executable, "-m", "sparkserve", "router", "--prefill", prefill_url,
                       "8998", "--decode", decode_url, "--host", "127.0.0.1", "--port", "30001",
                       "--log-level", "warning")]
    try:
        client = hosts.run(hosts.b, sys.executable, "-c", PD_CLIENT, prefill_url, decode_url, router_url,
                           json.dumps(bodies))
        code, out = _finish(client, 150)
    finally:
        logs = []
        for p in procs:
            p.terminate()
            logs.append(_finish(p, 20)[1])
    assert code == 0, f"{out[-2000:]}\n--- prefill:\n{logs[0][-3000:]}\n--- decode:\n{logs[1][-3000:]}"
    for want, status, got in json.loads(out.splitlines()[-1]):
        assert status == 200, got
        pairs = zip(want if isinstance(want, list) else [want], got if isinstance(got, list) else [got],
                    strict=True)
        assert all((a["text"], a["output_ids"]) == (b["text"], b["output_ids"]) for a, b in pairs)
    assert logs[0].count("Prefill batch") > 0 and logs[1].count("Prefill batch") == 0, logs[1][-3000:]


# ---- node 0, run by the tests above inside its namespace --------------------------------------
def _node0_main(mode: str, model: str, dist_timeout: str) -> None:
    sys.path.insert(0, HERE)
    sys.path.insert(0, os.path.dirname(HERE))
    from parallel_fixtures import run_mixed

    from sparkserve import Engine

    def plain(results):
        keys = ("output_token_logprobs", "output_top_logprobs")
        return [{"output_ids": r["output_ids"], "meta_info": {k: r["meta_info"][k] for k in keys}}
                for r in results]
    try:
        want = plain(run_mixed(Engine(model, **COMMON)))
        with Engine(model, tp_size=2, nnodes=2, node_rank=0, dist_init_addr=ADDR,
                    dist_timeout=float(dist_timeout), **COMMON) as eng:
            got = plain(run_mixed(eng))
        print(json.dumps({"want": want, "got": got}), flush=True)
    except Exception as e:
        print(json.dumps({"error": f"{type(e).__name__}: {e}"}), flush=True)


if __name__ == "__main__":
    _node0_main(*sys.argv[1:4])
