import 'uplot/dist/uPlot.min.css';
import '../../elastic_magic/ui/live_charts.css';
import './base.css';
