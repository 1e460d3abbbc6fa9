"""What the batch stage measures with: clocks, machine load, profilers, ratio estimates."""
