"""The multi-host harness that tests/ and benchmarks/ share (not part of meshnode; not in the wheel).

- ``harness.netns``: hosts as Linux network namespaces on a private bridge (``netns_mesh``).
- ``harness.cluster``: real ``meshnode run`` processes on those hosts (``node_argv``, ``Cluster``),
  running Python inside a host (``in_ns``), requests from a host (``fetch``, ``mesh_view``) and
  waiting for a condition (``wait_until``) or for a node's ``/v1/mesh`` to show one (``wait_mesh``).
- ``harness.requester``: the requests behind ``fetch``, made by one long-lived process per host.
"""
