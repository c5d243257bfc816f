import os
import signal
import socket
import subprocess
import sys
import textwrap
import time

import pytest

from bus.server import EmbeddedServer, ServerError, find_binary, free_port, render_config, validate_config_file


def test_binary_is_installed_with_the_wheel():
    out = subprocess.run([find_binary(), "--version"], capture_output=True, text=True)
    assert out.returncode == 0 and "nats-server" in out.stdout


def test_start_healthz_restart_on_same_store_and_stop(tmp_path):
    srv = EmbeddedServer(store_dir=str(tmp_path / "s"))
    srv.start()
    pid = srv.proc.pid
    varz = srv.varz()
    assert varz["max_payload"] >= 8 * 1024 * 1024
    assert varz["jetstream"]["config"]["store_dir"].startswith(str(tmp_path))
    port = srv.port
    srv.kill()
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    srv.start()  # same ports, same store
    assert srv.port == port and srv.varz()["port"] == port
    srv.close()
    assert srv.proc is None


def test_free_port_never_hands_out_one_port_twice():
    """The kernel may give one port to two binds to 0 in a row; a server given it twice (client and
    monitoring) exits at once (seen once in the suite)."""
    ports = [free_port() for _ in range(1000)]  # about 30 repeats without the record
    assert len(set(ports)) == len(ports)


def test_a_chosen_port_taken_before_the_server_binds_it_is_chosen_again(tmp_path, monkeypatch):
    """Another process binds the chosen port between the choice and the server's bind: the server
    starts on another one. A port the caller gave is not changed: the error names the cause."""
    import bus.server

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = taken.getsockname()[1]
        real, handed = bus.server.free_port, []

        def first_the_busy_one(host="127.0.0.1"):
            handed.append(busy if not handed else real(host))
            return handed[-1]

        monkeypatch.setattr(bus.server, "free_port", first_the_busy_one)
        srv = EmbeddedServer(store_dir=str(tmp_path / "s"), log_file=str(tmp_path / "nats.log"))
        try:
            srv.start()
            assert busy in handed and srv.port != busy and srv.http_port != busy
            assert srv.varz()["port"] == srv.port
        finally:
            srv.close()
        given = EmbeddedServer(store_dir=str(tmp_path / "g"), port=busy, log_file=str(tmp_path / "g.log"))
        with pytest.raises(ServerError, match="address already in use"):
            given.start()
        given.close()


def test_generated_config_validates_and_rejects_bad_payload(tmp_path):
    p = tmp_path / "c.conf"
    p.write_text(render_config(host="127.0.0.1", port=4999, http_port=8999, store_dir=str(tmp_path), max_payload=8 << 20))
    ok, out = validate_config_file(str(p))
    assert ok, out
    with pytest.raises(ServerError, match="max_payload"):
        render_config(host="127.0.0.1", port=1, http_port=2, store_dir="x", max_payload=128 << 20)


def test_no_orphan_when_parent_is_killed(tmp_path):
    """A process that started a server and is then SIGKILLed takes its server down with it."""
    code = textwrap.dedent(f"""
        import sys, time
        from bus.server import EmbeddedServer
        s = EmbeddedServer(store_dir={str(tmp_path / 's')!r}).start()
        print(s.proc.pid, flush=True)
        time.sleep(60)
    """)
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    child = int(parent.stdout.readline())
    os.kill(child, 0)
    parent.send_signal(signal.SIGKILL)
    parent.wait()
    for _ in range(100):
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            break
        time.sleep(0.05)
    else:
        pytest.fail("nats-server outlived its killed parent")


def test_port_taken_sees_a_listener():
    import socket

    from bus.server import port_taken

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        assert port_taken("127.0.0.1", port)
    assert not port_taken("127.0.0.1", port)


def test_nats_help_states_the_monitoring_default(capsys):
    from diloco.cli import cmd_nats

    with pytest.raises(SystemExit):
        cmd_nats(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "monitoring port on 127.0.0.1 (default: 0, a free one, printed in the ready line" in text
    assert "client port (default: 4222" in text


def _diloco_nats(tmp_path, name: str, *args: str) -> subprocess.Popen:
    env = {**os.environ, "TMPDIR": str(tmp_path / "tmp")}  # where its temp config dir goes
    return subprocess.Popen([sys.executable, "-m", "diloco.cli", "nats", "--port", "0", "--store-dir",
                             str(tmp_path / name), *args], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


@pytest.mark.timeout(90)
def test_two_diloco_nats_side_by_side_and_no_temp_dir_after_a_signal(tmp_path):
    """Two `diloco nats` on one machine both start (the monitoring port is a free one unless told);
    a third on a taken port says so in one line; SIGTERM and SIGINT each leave no temp config dir."""
    (tmp_path / "tmp").mkdir()
    procs = [_diloco_nats(tmp_path, "a"), _diloco_nats(tmp_path, "b")]
    try:
        ready = [p.stdout.readline() for p in procs]
        assert all(line.startswith("nats-server ready: nats://127.0.0.1:") for line in ready), ready
        monitors = [line.split("(monitoring ")[1].split(",")[0] for line in ready]
        assert len(set(monitors)) == 2 and not any(m.endswith(":8222") for m in monitors), monitors
        assert len(list((tmp_path / "tmp").glob("diloco-nats-conf-*"))) == 2
        taken = monitors[0].rsplit(":", 1)[1]
        third = _diloco_nats(tmp_path, "c", "--http-port", taken)
        _, err = third.communicate(timeout=30)
        assert third.returncode == 2 and err.strip().count("\n") == 0, err
        assert f"--http-port {taken}: 127.0.0.1:{taken} is in use" in err, err
        procs[0].send_signal(signal.SIGTERM)
        procs[1].send_signal(signal.SIGINT)
        for p in procs:
            _, err = p.communicate(timeout=30)
            assert p.returncode == 0, err
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert list((tmp_path / "tmp").iterdir()) == []  # nothing left behind
