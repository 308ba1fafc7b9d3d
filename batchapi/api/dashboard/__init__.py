"""The dashboard's pages (``batchapi/api/routes/dashboard.py``): templates, static files, the
view values they show and the server-drawn SVG charts."""
