"""Session-wide fixtures: one Ray instance (tests/fixtures_ray.py) and one moto S3 server
(tests/fixtures_s3.py) per test session, each started only when a test asks for it."""
pytest_plugins = ["tests.fixtures_ray", "tests.fixtures_s3"]
