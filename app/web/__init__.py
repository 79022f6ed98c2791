"""What every dashboard page shares: templating, CSRF, page dependencies and rendering, and
the sign-in session. The pages themselves live in their domains (``<domain>/views.py``)."""
