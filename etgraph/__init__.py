"""etgraph: ElasticTrainer (MobiSys '23) as a graph-level optimizer over ONNX models.

Data flows one way: model -> tensor graph -> timings -> selection -> artifacts -> training.
"""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("etgraph")
except PackageNotFoundError:  # running from a source tree that is not installed
    __version__ = "0.0.0+unknown"

__all__ = ["__version__"]
