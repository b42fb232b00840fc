"""What the trainer reports: metrics, TensorBoard, W&B, the attempt's reports, profiles."""
