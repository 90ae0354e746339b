"""Session-wide fixtures: one Ray instance (tests/fixtures_ray.py) and one moto S3 server
(tests/fixtures_s3.py) per test session, each started only when a test asks for it.

Markers say what a test needs (registered in pyproject.toml): every test that uses the
``ray_session`` fixture (directly or through another fixture) is marked ``ray``, every one that
uses ``s3_server`` is marked ``s3``; tests that start Ray or S3 otherwise carry the marker
themselves (``multinode`` for a cluster of several nodes). Tests marked ``cluster`` (also marked
``multinode``) connect this process to a multi-node cluster of their own, which cannot share a
process with the session's Ray instance: when a run without ``-m`` selects them beside tests of
the session's Ray, they are deselected and the run says how to run them (``make test`` runs them
in a second process)."""
import pytest

pytest_plugins = ["tests.fixtures_ray", "tests.fixtures_s3"]

_MARK_BY_FIXTURE = {"ray_session": "ray", "s3_server": "s3"}


@pytest.hookimpl(tryfirst=True)  # before -m deselects by these markers
def pytest_collection_modifyitems(config, items):
    for item in items:
        used = set(getattr(item, "fixturenames", ()))
        for fixture, mark in _MARK_BY_FIXTURE.items():
            if fixture in used and item.get_closest_marker(mark) is None:
                item.add_marker(getattr(pytest.mark, mark))
        if item.get_closest_marker("cluster") is not None and item.get_closest_marker("multinode") is None:
            item.add_marker(pytest.mark.multinode)
    own = [i for i in items if i.get_closest_marker("cluster") is not None]
    session_ray = any(i.get_closest_marker("ray") is not None and i.get_closest_marker("cluster") is None for i in items)
    if own and session_ray and not config.getoption("markexpr"):  # -m decides where it is given
        config.hook.pytest_deselected(items=own)
        items[:] = [i for i in items if i.get_closest_marker("cluster") is None]
        config._raydcp_cluster_deselected = len(own)


def pytest_terminal_summary(terminalreporter, config):
    n = getattr(config, "_raydcp_cluster_deselected", 0)
    if n:
        terminalreporter.write_line(f"{n} multi-node cluster tests deselected: they need a process of their own; "
                                    "run `pytest -m cluster tests/cluster` (make test runs both)")
