"""The one door to the Kubernetes API: the cluster adapter built once at start-up and handed to every
user (reconcile, autoscaler, gateway), and the helpers that read kopf's indexes."""
