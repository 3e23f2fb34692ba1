"""The Kubernetes device plugin (`gpuhook plugin`): gpuhook.plugin.server. Imports grpcio, so
nothing on the hook's path may import this package."""
