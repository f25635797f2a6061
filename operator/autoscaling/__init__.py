"""The SLO autoscaler: engine metrics (expositions and histograms), decisions (pure) and the loop
that reads the engines and writes replicas."""
