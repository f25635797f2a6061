"""The controller: render (children as manifests), reconcile and status (pure), and the thin kopf
handlers that wire them to the cluster."""
