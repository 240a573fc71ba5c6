"""Who may call what: ``peers`` (mutual TLS: the peer's certificate identity and the API group
it may use), ``access`` (the restricted model-control and repository APIs, by token or
certificate) and ``tenancy`` (the edge's tenant and permission headers, trusted only from
Envoy's identity).
"""
