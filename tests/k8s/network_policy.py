"""The Kubernetes NetworkPolicy API for tests: its schema, and what a policy admits.

``NETWORK_POLICY_SCHEMA`` is ``networking.k8s.io/v1`` NetworkPolicy as the Kubernetes API
reference (v1.30) gives its fields, strict as ``chart.rayservice_schema`` is (an unknown key is
an error), with the API server's own checks on top: a peer names at least one selector, an
``ipBlock`` stands alone, a port is 1-65535 or a name, the protocol is TCP, UDP or SCTP.

``admits`` is the rule a network plugin enforces, as that reference states it: a pod that some
policy of type Ingress selects takes a connection only when one of the policy's ingress rules
allows it; a rule allows it when its ``from`` is empty or one peer matches the source, and its
``ports`` is empty or one port matches. A ``podSelector`` alone matches pods of the policy's
namespace; a ``namespaceSelector`` pods in the namespaces it selects; both together, pods that
both select; an ``ipBlock`` addresses.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field
from typing import Any

_LABELS = {"type": "object", "additionalProperties": {"type": "string", "maxLength": 63}}
_SELECTOR = {
    "type": "object",
    "additionalProperties": False,
    "properties": {
        "matchLabels": _LABELS,
        "matchExpressions": {"type": "array", "items": {
            "type": "object", "additionalProperties": False, "required": ["key", "operator"],
            "properties": {"key": {"type": "string", "minLength": 1},
                           "operator": {"enum": ["In", "NotIn", "Exists", "DoesNotExist"]},
                           "values": {"type": "array", "items": {"type": "string"}}}}},
    },
}
_PEER = {
    "type": "object",
    "additionalProperties": False,
    "minProperties": 1,
    "properties": {
        "podSelector": _SELECTOR,
        "namespaceSelector": _SELECTOR,
        "ipBlock": {"type": "object", "additionalProperties": False, "required": ["cidr"],
                    "properties": {"cidr": {"type": "string"},
                                   "except": {"type": "array", "items": {"type": "string"}}}},
    },
    "if": {"required": ["ipBlock"]},
    "then": {"maxProperties": 1},
}
_PORT = {
    "type": "object",
    "additionalProperties": False,
    "properties": {
        "port": {"oneOf": [{"type": "integer", "minimum": 1, "maximum": 65535},
                           {"type": "string", "pattern": "^[a-z0-9]([a-z0-9-]{0,13}[a-z0-9])?$"}]},
        "endPort": {"type": "integer", "minimum": 1, "maximum": 65535},
        "protocol": {"enum": ["TCP", "UDP", "SCTP"]},
    },
}
_RULE = {"type": "object", "additionalProperties": False,
         "properties": {"from": {"type": "array", "items": _PEER},
                        "ports": {"type": "array", "items": _PORT}}}
NETWORK_POLICY_SCHEMA: dict[str, Any] = {
    "type": "object",
    "additionalProperties": False,
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "networking.k8s.io/v1"},
        "kind": {"const": "NetworkPolicy"},
        "metadata": {
            "type": "object", "additionalProperties": False, "required": ["name"],
            "properties": {"name": {"type": "string", "maxLength": 253,
                                    "pattern": "^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$"},
                           "namespace": {"type": "string"}, "labels": _LABELS,
                           "annotations": {"type": "object"}},
        },
        "spec": {
            "type": "object", "additionalProperties": False, "required": ["podSelector"],
            "properties": {
                "podSelector": _SELECTOR,
                "policyTypes": {"type": "array", "items": {"enum": ["Ingress", "Egress"]}},
                "ingress": {"type": "array", "items": _RULE},
                "egress": {"type": "array", "items": {
                    "type": "object", "additionalProperties": False,
                    "properties": {"to": {"type": "array", "items": _PEER},
                                   "ports": {"type": "array", "items": _PORT}}}},
            },
        },
    },
}


@dataclass
class Source:
    """Where a connection comes from: a pod (its namespace, the namespace's labels, its own
    labels) or, with ``pod_labels`` None, an address outside the cluster's pods."""

    namespace: str = ""
    namespace_labels: dict[str, str] = field(default_factory=dict)
    pod_labels: dict[str, str] | None = None
    ip: str = "10.0.0.1"

    def __post_init__(self) -> None:
        if self.namespace:  # the API server labels every namespace with its name
            self.namespace_labels = {"kubernetes.io/metadata.name": self.namespace,
                                     **self.namespace_labels}


def selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    """Whether a LabelSelector selects ``labels`` ({} selects everything)."""
    if not (selector.get("matchLabels") or {}).items() <= labels.items():
        return False
    for expr in selector.get("matchExpressions") or []:
        key, op, values = expr["key"], expr["operator"], expr.get("values") or []
        ok = {"In": key in labels and labels[key] in values,
              "NotIn": key not in labels or labels[key] not in values,
              "Exists": key in labels, "DoesNotExist": key not in labels}[op]
        if not ok:
            return False
    return True


def _peer_matches(peer: dict[str, Any], source: Source, namespace: str) -> bool:
    if "ipBlock" in peer:
        address = ipaddress.ip_address(source.ip)
        block = peer["ipBlock"]
        return (address in ipaddress.ip_network(block["cidr"])
                and not any(address in ipaddress.ip_network(c) for c in block.get("except", [])))
    if source.pod_labels is None:
        return False
    if "namespaceSelector" in peer:
        in_namespace = selects(peer["namespaceSelector"], source.namespace_labels)
    else:
        in_namespace = source.namespace == namespace
    return in_namespace and selects(peer.get("podSelector", {}), source.pod_labels)


def _port_matches(rule_port: dict[str, Any], port: int) -> bool:
    if rule_port.get("protocol", "TCP") != "TCP":
        return False
    wanted = rule_port.get("port")
    if wanted is None:  # every port
        return True
    if isinstance(wanted, str):
        raise ValueError(f"named port {wanted!r}: the pods' container ports are not modelled here")
    return wanted <= port <= rule_port.get("endPort", wanted)


def admits(policy: dict[str, Any], pod_labels: dict[str, str], port: int, source: Source,
           namespace: str = "default") -> bool:
    """Whether ``policy`` (in ``namespace``) lets ``source`` open TCP ``port`` on a pod of that
    namespace with ``pod_labels``."""
    spec = policy["spec"]
    if not selects(spec["podSelector"], pod_labels) or "Ingress" not in spec["policyTypes"]:
        return True  # this policy does not isolate that pod's ingress
    for rule in spec.get("ingress") or []:
        peers, ports = rule.get("from") or [], rule.get("ports") or []
        if ((not peers or any(_peer_matches(p, source, namespace) for p in peers))
                and (not ports or any(_port_matches(p, port) for p in ports))):
            return True
    return False
