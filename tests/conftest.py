"""Session-wide fixtures: one Ray instance (tests/fixtures_ray.py) and one moto S3 server
(tests/fixtures_s3.py) per test session, each started only when a test asks for it.

Markers say what a test needs (registered in pyproject.toml): every test that uses the
``ray_session`` fixture (directly or through another fixture) is marked ``ray``, every one that
uses ``s3_server`` is marked ``s3``; tests that start Ray or S3 otherwise carry the marker
themselves (``multinode`` for a cluster of several nodes)."""
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
