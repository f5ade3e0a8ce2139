"""The notebook side: the %%elastic and %elastic magics, sessions, the
Python API's launch(), and the comm the JupyterLab extension talks to. Only this side (and ui/)
imports IPython; the agent and the workers never import it."""
