"""What the tests share: models, loaders, recorders, the search's test models, the process environment."""
