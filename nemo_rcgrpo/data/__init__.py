"""Data: chat formats, trajectories, failures, splits and the prepared datasets."""
