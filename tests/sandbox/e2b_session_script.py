"""A standalone e2b SDK session against E2B_API_URL / E2B_SANDBOX_URL; prints SESSION-OK on success.

Run by test_sandbox_e2b.py under another interpreter (e.g. a venv with e2b 2.48) to cover older SDKs.
"""
from e2b import CommandExitException, Sandbox

sb = Sandbox.create(timeout=120)
try:
    assert sb.commands.run("python3 -c 'print(6*7)'").stdout == "42\n"
    try:
        sb.commands.run("exit 5")
        raise AssertionError("exit 5 did not raise")
    except CommandExitException as e:
        assert e.exit_code == 5
    sb.files.write("/home/user/x.txt", "legacy")
    assert sb.files.read("/home/user/x.txt") == "legacy"
    sb.set_timeout(200)
    assert sb.sandbox_id in [s.sandbox_id for s in Sandbox.list().next_items()]
    assert sb.pause()
    again = Sandbox.connect(sb.sandbox_id)
    assert again.commands.run("cat /home/user/x.txt").stdout == "legacy"
finally:
    sb.kill()
assert not sb.is_running()
print("SESSION-OK")
