"""The Narwhal router conformance suite (README.md): cases as data under cases/, a runner
(`narwhal conformance`), the mock fleet on documented loopback ports, reports and the
live fuzzing mode.

Public surface: `SUITE_VERSION`; narwhal_conformance.cli (add_arguments, run);
.cases (load_cases, check_cases); .profiles (PROFILES, router_config); .fleet
(running_fleet); .runner (Runner); .capabilities (CAPABILITIES); .etcd (running_etcd:
the etcd a run starts for capability ha-etcd).
"""

SUITE_VERSION = "2.4.0"
SUITE_MAJOR = 2  # cases carry `since: N`; `--suite-version N` runs the cases of version N

__all__ = ["SUITE_VERSION", "SUITE_MAJOR"]
