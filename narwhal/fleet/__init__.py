"""Fleet membership at run time: where engines come from besides engines[] at start.

A source (`source.Source`) watches one place (a file, an etcd prefix; on paper a DNS name
or Kubernetes EndpointSlices) and emits the whole set of engines it names each time that
set may have changed (`Snapshot`), or why it cannot say (`SourceError`). The authority
(narwhal/authority/membership.py) applies a snapshot as one diff against the engines that
source owns, by the rows of spec/tables/lifecycle.yaml. Sources never touch the fleet
themselves and import nothing of the authority.
"""
