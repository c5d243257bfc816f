import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from bus.server import EmbeddedServer, ServerError, find_binary, render_config, validate_config_file


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
