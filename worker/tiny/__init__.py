"""The tiny random models of the tests and offline demos, built locally: nothing is downloaded."""
