"""tunegate load replay: Locust users and shapes that replay captured request distributions."""
